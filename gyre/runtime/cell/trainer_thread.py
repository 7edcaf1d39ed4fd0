"""The core's trainer thread on rank 0: where the core cell's training work runs, in order, beside the controller's
event loop (docs/runtime.md, "The process model").

The controller owns rank 0's event loop; the core's trainer must not block it (a step is seconds to hours of
compute and collectives). `TrainerThread.submit(fn, *args)` runs `fn(*args)` on one daemon thread, in submission
order, and returns an asyncio future the loop awaits. One thread, so the core's TCPStore client and weight
transport (used by one thread at a time) live there, and the collectives of the core's steps are issued from one
thread in the order every other rank issues them. A daemon thread: a job that is stopping while the core waits in
a collective is not held at interpreter exit (the process group is torn down with the process).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["TrainerThread"]


class TrainerThread:
    """One daemon thread that runs submitted callables in order (module docstring)."""

    def __init__(self, name: str = "gyre-core-trainer") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run `fn(*args)` on the thread after what was submitted before; an asyncio future of its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def close(self) -> None:
        """Let the thread end after the submitted work (it does not wait: a stuck collective must not hang us)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                outcome = (fn(*args), None)
            except BaseException as error:  # delivered to the awaiting coroutine
                outcome = (None, error)
            try:
                loop.call_soon_threadsafe(_set, future, *outcome)
            except RuntimeError:  # the loop has closed: nobody awaits this any more
                return


def _set(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting side was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
