"""Keep the garbage collector's full collections off the request path.

The proxy's heap is mostly long-lived: trajectory trees, cached histories and prompts of executions that run for
hours. CPython's full (generation 2) collection walks every tracked object, and it runs whenever the heap grew by
a quarter, so its pauses grow with the heap: 80-230 ms in `benchmarks/proxy_overhead.py` (b), which is the p99
latency of every call it lands in. `gc.freeze()` moves all current objects into the permanent generation, which
collections skip; objects there are still freed by reference counting when dropped, only reference *cycles*
among them wait. So: freeze every `freeze_every` calls, and every `full_every_s` unfreeze and collect once (one
planned pause, at most every ten minutes by default) so frozen cyclic garbage is reclaimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

log = logging.getLogger(__name__)


class HeapFreezer:
    def __init__(self, freeze_every: int, full_every_s: float):
        self.freeze_every = freeze_every
        self.full_every_s = full_every_s
        self.calls = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Freeze what start-up built; from a running loop, schedule the periodic full collection."""
        if self.freeze_every:
            gc.freeze()
            if self.full_every_s:
                self._task = asyncio.get_running_loop().create_task(self._collect_periodically())

    def call_done(self) -> None:
        self.calls += 1
        if self.freeze_every and self.calls % self.freeze_every == 0:
            gc.freeze()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _collect_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.full_every_s)
            started = time.perf_counter()
            gc.unfreeze()
            collected = gc.collect()
            gc.freeze()
            log.info("full garbage collection: %d objects in %.0f ms", collected, 1e3 * (time.perf_counter() - started))
