"""The control plane: the controller's decisions, delivered to every rank in order, exactly once, while ranks work.

Role: rank 0's controller decides (a cell changes role, a step starts with its participating cells, a cell joins
a step in flight, the core gathers weights, the job stops); every rank must act on each decision, but ranks spend
their time inside micro-step claims and collectives, where a broadcast over a process group cannot reach them.
So decisions go through the job's key-value store (the TCPStore every rank already has) as an append-only log,
and each rank reads it on a listener thread of its own, which hands decisions to the rank's main loop through a
queue it looks at between micro-steps (docs/distributed.md, "Control plane").

Keys (under `gyre/control/`):
- `next`: the log's length counter; `publish` takes index `store.add(next, 1) - 1`, so two publishers never write
  the same index;
- `d/{i}`: decision i, JSON (`{"seq": i, "kind": ..., "fields": {...}}`), written once, never changed.

Contract:
- a reader delivers decisions in index order, each exactly once (`Decision.seq` is the index: a rank can check it
  applies them in sequence), and a reader started late (a rank that restarted, a satellite that attaches) catches
  up from index 0 or from where it says;
- every wait is bounded: `ControlReader.next(timeout_s)` returns None when nothing new came in time; the listener
  ends when a `stop` decision has been delivered or when `close()` is called;
- a decision is JSON-able and at most `STORE_VALUE_MAX_BYTES` (8 MiB: TCPStore drops a client that sends more);
  anything else is refused before it reaches the store. Weights never travel here (docs/distributed.md, transports).
- a TCPStore client is used by one thread: give the listener a client of its own (`make_store`).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre.distributed.claims import STORE_VALUE_MAX_BYTES

__all__ = ["STOP", "ControlListener", "ControlPublisher", "ControlReader", "Decision"]

PREFIX = "gyre/control/"
STOP = "stop"  # the kind of the decision that ends every listener once delivered
POLL_S = 0.2  # how long one store wait lasts before a listener looks at its close flag again
CHECK_EVERY_S = 0.01  # a decision reaches a waiting reader within this (plus a store round trip)


@dataclass(frozen=True)
class Decision:
    seq: int  # its index in the log: decisions are applied in seq order
    kind: str  # e.g. "role", "step", "join", "gather", "stop" (the runtime's vocabulary, docs/runtime.md)
    fields: dict[str, Any] = field(default_factory=dict)


def _key(index: int) -> str:
    return f"{PREFIX}d/{index}"


def _wait(store: Any, key: str, timeout_s: float) -> bool:
    """Whether `key` exists within `timeout_s`. Polls `check` (a round trip of ~0.1 ms): the store's own `wait`
    logs a C++ warning to stderr at every timeout, which a listener waiting for hours would repeat endlessly."""
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([key]):
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(CHECK_EVERY_S, remaining))


class ControlPublisher:
    """The controller's side: appends decisions to the log."""

    def __init__(self, store: Any):
        self.store = store

    def publish(self, kind: str, **fields: Any) -> int:
        """Append one decision; returns its index. `ValueError`/`TypeError` (nothing written) for a bad one."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind={kind!r}: expected a non-empty string")
        try:
            fields_json = json.dumps(fields, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"decision {kind!r}: its fields must be JSON-able ({error})") from None
        size = len(fields_json) + len(kind) + 64  # with the seq and kind around it
        if size > STORE_VALUE_MAX_BYTES:
            raise ValueError(
                f"decision {kind!r} is {size} bytes: at most {STORE_VALUE_MAX_BYTES} travel through the store "
                "(send weights over a transport, not the control plane)"
            )
        index = self.store.add(f"{PREFIX}next", 1) - 1
        self.store.set(_key(index), f'{{"seq":{index},"kind":{json.dumps(kind)},"fields":{fields_json}}}')
        return index


class ControlReader:
    """One rank's cursor over the log: `next` gives each decision once, in order."""

    def __init__(self, store: Any, *, start: int = 0):
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start={start!r}: expected an index >= 0")
        self.store = store
        self.next_index = start

    def next(self, timeout_s: float) -> Decision | None:
        """The next decision, waiting at most `timeout_s`; None if none came in time (ask again)."""
        key = _key(self.next_index)
        if not _wait(self.store, key, timeout_s):
            return None
        raw = json.loads(self.store.get(key))
        decision = Decision(seq=raw["seq"], kind=raw["kind"], fields=raw["fields"])
        if decision.seq != self.next_index:
            raise RuntimeError(f"control log: entry {self.next_index} says it is {decision.seq}")
        self.next_index += 1
        return decision


class ControlListener:
    """A daemon thread reading the log for one rank; the rank's loop takes decisions with `get` or `drain`.

    `make_store` returns the listener's own store client. The thread ends after delivering a `STOP` decision, on
    `close()`, or on a store error (kept in `error` and raised by the next `get`/`drain`)."""

    def __init__(self, make_store: Callable[[], Any], *, start: int = 0, name: str = "gyre-control"):
        self._decisions: queue.Queue[Decision] = queue.Queue()
        self._closing = threading.Event()
        self.error: BaseException | None = None
        self._reader = ControlReader(make_store(), start=start)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                decision = self._reader.next(POLL_S)
                if decision is None:
                    continue
                self._decisions.put(decision)
                if decision.kind == STOP:
                    return
        except BaseException as error:  # delivered to the rank's loop, which decides what to do
            self.error = error

    def get(self, timeout_s: float) -> Decision | None:
        """The next decision, waiting at most `timeout_s` (None if none came)."""
        self._raise_error()
        try:
            return self._decisions.get(timeout=timeout_s)
        except queue.Empty:
            self._raise_error()
            return None

    def drain(self) -> list[Decision]:
        """Every decision delivered and not yet taken, in order, without waiting (between micro-steps)."""
        self._raise_error()
        taken = []
        while True:
            try:
                taken.append(self._decisions.get_nowait())
            except queue.Empty:
                return taken

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        self._closing.set()
        self._thread.join(timeout_s)

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the control listener stopped: {self.error}") from self.error
