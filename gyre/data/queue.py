"""The micro-step queue of one batch (one stream): atomic, disjoint claims by training cells.

Role: the stream packing buffer `put`s micro-steps as it materializes groups and `close`s the queue
after the batch's B-th group; training cells `claim` micro-steps whenever compute frees up, so earlier
or faster cells take more of them (paper: "Streaming training with dynamic membership").

Contract:
- Thread-safe: every method runs under one `threading.Lock` (through a `threading.Condition` built on
  it). Each micro-step put is handed to exactly one `claim` (claims are disjoint and nothing is lost);
  FIFO order.
- `claim(cell)` returns the next micro-step, or None when none is queued. None means one of two things,
  told apart by `closed_and_drained`: the stream is still open and more may come (the cell stops at a
  consistent scheduling point and claims again, or passes `timeout` to wait here), or the batch is
  done (closed and drained: the cell flushes its pipeline). With `timeout` (seconds, None = wait
  without limit) a claim on an empty open queue blocks until a put, a close or the timeout.
- `put` after `close` is a ValueError: a closed stream is complete.
- One queue per batch; the next batch gets a new queue. Cross-process claims (gyre/distributed) will wrap the
  same small interface: `put`, `claim(cell)`, `close`, `closed_and_drained`.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

from gyre.config.checks import is_int

__all__ = ["MicroStepQueue"]

T = TypeVar("T")


class MicroStepQueue(Generic[T]):
    """FIFO of micro-steps with atomic claims. `T` is the micro-step type (`gyre.data.MicroStep`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._items: collections.deque[T] = collections.deque()
        self._closed = False
        self._num_put = 0
        self._claims: list[tuple[int, int]] = []  # (put sequence number, cell), in claim order

    def put(self, step: T) -> None:
        """Enqueue one micro-step. ValueError once the queue is closed."""
        with self._lock:
            if self._closed:
                raise ValueError(
                    f"the micro-step queue is closed after {self._num_put} micro-steps: a closed stream takes "
                    "no more (start the next batch's stream)"
                )
            self._items.append(step)
            self._num_put += 1
            self._changed.notify()

    def claim(self, cell: int, timeout: float | None = 0.0) -> T | None:
        """Atomically take the next micro-step for `cell`, or None (see the module docstring).

        timeout: 0 (default) returns at once; a number of seconds > 0 waits at most that long while the
        queue is empty and open; None waits until a put or a close.
        """
        if not is_int(cell) or cell < 0:
            raise ValueError(f"cell must be a cell index (an int >= 0), got {cell!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout must be None (wait for a put or close) or seconds >= 0, got {timeout!r}")
        with self._lock:
            if not self._items and not self._closed and timeout != 0:
                self._changed.wait_for(lambda: bool(self._items) or self._closed, timeout=timeout)
            if not self._items:
                return None
            step = self._items.popleft()
            self._claims.append((self._num_put - len(self._items) - 1, cell))
            return step

    def close(self) -> None:
        """Mark the stream complete: no more puts. Waiting claims wake up. Idempotent."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    @property
    def closed_and_drained(self) -> bool:
        """The batch's micro-steps are all claimed: a cell that gets None now flushes its pipeline."""
        with self._lock:
            return self._closed and not self._items

    @property
    def pending(self) -> int:
        """Micro-steps put and not yet claimed."""
        with self._lock:
            return len(self._items)

    @property
    def num_put(self) -> int:
        with self._lock:
            return self._num_put

    def claims(self) -> list[tuple[int, int]]:
        """(put sequence number, cell) of every claim so far, in claim order (monitoring and tests)."""
        with self._lock:
            return list(self._claims)

    def __repr__(self) -> str:
        with self._lock:
            return (
                f"MicroStepQueue(put={self._num_put}, pending={len(self._items)}, "
                f"claimed={len(self._claims)}, closed={self._closed})"
            )
