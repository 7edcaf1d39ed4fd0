"""`python -m gyre.serve`: the proxy plus an embedded native engine (see `gyre.serve.app`, docs/serve.md)."""
