"""The black-box proxy: API dialects in, token ids to the engines, TITO records out (docs/proxy.md)."""
