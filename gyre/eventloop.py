"""The event loop gyre's servers run on: uvloop where it is installed (Linux, macOS), else asyncio's own.

The proxy stack's probes (docs/proxy.md) ran on uvloop (aiohttp + orjson on uvloop: ~0.5 ms CPU per
request); it roughly halves the per-request cost of socket IO against the default loop. Entry points call
`run(main())`; threads that host a loop call `new_event_loop()`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run(main)` on the loop `new_event_loop` makes."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(main)
    loop = new_event_loop()  # Python 3.10: no Runner
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
