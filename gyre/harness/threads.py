"""The threads that run executions' blocking calls (sandbox prepare, release and removal, workspace copies,
evaluations) off the event loop: one pool of their own, not asyncio's default executor.

asyncio's default executor has min(32, cores + 4) threads: 6 on a 2-core machine. An evaluation holds its thread
for its whole run (up to the evaluator's time limit), and a container sandbox's calls wait on the engine; with 16
executions in flight, every prepare, release and removal queued behind them, and so did the controller's own
`to_thread` work (measured with the container sandbox: 13 s from a harness's end to its execution's end, p50,
against 0.66 s under bubblewrap). Threads are made as calls need them (a `ThreadPoolExecutor` starts one per
submitted call while fewer than its maximum run) and stay idle otherwise.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["EXECUTION_THREADS", "blocking"]

EXECUTION_THREADS = 512  # above any node's executions in flight times their blocking calls at once
_pool = ThreadPoolExecutor(EXECUTION_THREADS, thread_name_prefix="gyre-execution")
T = TypeVar("T")


async def blocking(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`asyncio.to_thread(fn, *args, **kwargs)` on the executions' own pool (the caller's context variables too)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_pool, call)
