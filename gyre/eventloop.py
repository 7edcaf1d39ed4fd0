"""The event loop gyre's servers run on: uvloop where it is installed (Linux, macOS), else asyncio's own.

The proxy stack's probes (docs/proxy.md) ran on uvloop (aiohttp + orjson on uvloop: ~0.5 ms CPU per
request); it roughly halves the per-request cost of socket IO against the default loop. Entry points call
`run(main())`; a service on a thread of its own runs in a `LoopThread`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
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


class LoopThread:
    """A loop from `new_event_loop` run forever in a daemon thread: a service beside a rank's own work or a test's
    (`gyre.engine.endpoint.ServerThread`, `gyre.runtime.job.harness_host.HarnessHostThread`)."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._setup: Callable[[], Awaitable[Any]] | None = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, setup: Callable[[], Awaitable[Any]], *, what: str, timeout_s: float) -> None:
        """Run `setup()` in the thread (its loop current, not yet running), then its awaitable on the loop, which
        then runs forever. `what` names the service in the errors: TimeoutError, or RuntimeError from setup's."""
        self._setup = setup
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{what} did not start within {timeout_s} s")
        if self._failure is not None:
            raise RuntimeError(f"{what} failed to start: {self._failure!r}") from self._failure

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._setup())
        except BaseException as error:
            self._failure = error
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def call(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """`coroutine` run on the loop; its result, within `timeout_s`."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Stop the loop and wait up to `timeout_s` for the thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
