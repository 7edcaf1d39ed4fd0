"""gyre's stand-in for SGLang (see `gyre.engine.sglang_standin`): not SGLang."""

from .srt.entrypoints.engine import Engine

STANDIN = True

__all__ = ["STANDIN", "Engine"]
