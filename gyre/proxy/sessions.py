"""Executions and their keys: each execution gets its own API key, and the key selects its trajectory tree.

Role: the proxy authenticates every call by key (Anthropic `x-api-key` or `Authorization: Bearer`, OpenAI
`Authorization: Bearer`), finds the execution's `ExecutionSession` and records the call into that execution's
tree and record file (`gyre.traj.store`, one JSONL file per execution under `records_dir`). A harness can only
reach its own execution. Keys are random (`secrets.token_urlsafe`), never derived from the execution id.

Each session keeps one prompt builder per conversation thread (the main agent and each sub-agent extend their
own histories; `thread_key` picks the thread from the role signals), so interleaved threads do not evict each
other's cached turns. Recording is synchronous (tree insert, then one line appended), so two concurrent calls of
one execution never interleave a record.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.proxy.dialects.incremental import MessageCache
from gyre.traj.record import CallMeta, CallRecord, CallRouting, Provenance, Response, Segment
from gyre.traj.store import RecordWriter
from gyre.traj.tree import TrajectoryTree

log = logging.getLogger(__name__)

KEY_PREFIX = "gyre-"
MAX_THREADS = 64  # prompt builders and parse caches kept per execution (least recently used dropped)
# An execution id names its record file: letters, digits, '.', '_', '-', starting with a letter or digit, matched
# whole (`fullmatch`: `$` would accept a trailing newline), and no name a filesystem reserves for a device
# (Windows' CON, PRN, AUX, NUL, COM1-9, LPT1-9, also with an extension: `con.jsonl` cannot be created there).
_EXECUTION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RESERVED_NAMES = frozenset({"con", "prn", "aux", "nul", *(f"{d}{i}" for d in ("com", "lpt") for i in range(1, 10))})


class RecordError(RuntimeError):
    """A served call could not be written to its record file (its line does not serialize, the disk is full): the call
    is in neither the tree nor the file, and the execution goes on. The proxy answers that call with a 500 saying so."""


class ExecutionIdConflict(ValueError):
    """An execution id that is open (it has a key) or was closed: a closed execution's record file is final, so its
    id is never issued again (the admin route answers 409)."""


def new_key() -> str:
    """A fresh execution key: random, never derived from the execution id."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


def check_execution_id(execution: Any) -> str:
    """`execution` if it may name an execution (and its record file), else ValueError saying what is allowed."""
    if (
        not isinstance(execution, str)
        or not _EXECUTION_ID.fullmatch(execution)
        or execution.split(".")[0].lower() in _RESERVED_NAMES
    ):
        raise ValueError(
            f"execution={execution!r} is not allowed: expected 1-128 characters of letters, digits, '.', '_', "
            "'-', starting with a letter or digit, and not a reserved device name (con, prn, aux, nul, com1-9, "
            "lpt1-9); it names the record file"
        )
    return execution


def thread_key(signals: Mapping[str, Any]) -> str:
    """Which conversation thread of an execution a call continues: sub-agents get their own."""
    for name in ("x-gyre-agent-id", "x-claude-code-agent-id", "agent_id", "thread-id", "parent_thread_id"):
        value = signals.get(name)
        if value:
            return f"{name}={value}"
    return "main"


def key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The API key a request carries: `x-api-key`, or the token of `Authorization: Bearer <token>`."""
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


@dataclass(frozen=True)
class _LastCall:
    segments: tuple[Segment, ...]  # the call's context, as passed
    response_node: int
    response_ids: Any  # array("i") of its output


def _extends(segments: list[Segment], last: _LastCall) -> bool:
    """`segments` = the last call's context (the same objects) + its output (SAMPLED, same ids) + more."""
    k = len(last.segments)
    if len(segments) <= k:
        return False
    answer = segments[k]
    if answer.provenance is not Provenance.SAMPLED or answer.ids != last.response_ids:
        return False
    return all(new is old for new, old in zip(segments[:k], last.segments, strict=True))


@dataclass(eq=False)
class ExecutionSession:
    """One execution: its key, its tree, its record file, its payload cache and prompt builders."""

    execution: str
    key: str
    tree: TrajectoryTree
    writer: RecordWriter | None
    payload: Any  # gyre.proxy.render.PayloadCache
    make_builder: Callable[[Any], Any]  # payload cache -> PromptBuilder
    builders: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    build_locks: OrderedDict[str, asyncio.Lock] = field(default_factory=OrderedDict)
    parse_caches: OrderedDict[str, MessageCache] = field(default_factory=OrderedDict)
    _last_calls: dict[str, _LastCall] = field(default_factory=dict)  # thread -> its last recorded call
    calls_in_flight: int = 0  # calls admitted and not yet ended (their records not yet written)
    calls_recorded: int = 0  # calls in the tree and the record file
    # The registry's execution -> calls recorded, which outlives the session (`SessionRegistry.calls_recorded`).
    recorded_tally: dict[str, int] | None = None
    closing: bool = False  # closed by the admin while calls were in flight: closes when the last one ends

    @property
    def last_node(self) -> dict[str, int]:
        """Thread -> response node of its last recorded call."""
        return {thread: call.response_node for thread, call in self._last_calls.items()}

    def builder(self, thread: str):
        """The thread's prompt builder (keeps its previous request's turns and segments)."""
        return _lru(self.builders, thread, lambda: self.make_builder(self.payload))

    def build_lock(self, thread: str) -> asyncio.Lock:
        """Held while the thread's builder builds: one build at a time, even when a big one runs on a worker
        thread (`gyre.proxy.server`). Evicted with the builder: both tables see the same keys in the same order."""
        return _lru(self.build_locks, thread, asyncio.Lock)

    def parse_cache(self, thread: str) -> MessageCache:
        """The thread's previous body (gyre.proxy.body_reuse), raw messages and their parses (incremental parsing)."""
        return _lru(self.parse_caches, thread, MessageCache)

    def record(
        self,
        segments: Sequence[Segment],
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        finish_reason: str,
        meta: CallMeta,
        *,
        thread: str = "main",
        routing: CallRouting | None = None,
    ) -> CallRecord:
        """Insert one call into the tree and append it to the record file: both, or neither. Bad input is a
        ValueError; a line that cannot be written is a `RecordError` (the tree and the file stay as they were).

        When the call extends the thread's previous call (its segments start with the very same objects and then
        our previous output), the tree is entered at that call's response node: only the new segments are walked,
        so recording costs the same at a 700K-token history as at a short one."""
        segments = list(segments)
        parent, start = self._entry(segments, thread)
        response = Response.build(output_ids, logprobs, finish_reason)
        write = None if self.writer is None else self._write
        record = self.tree.insert(segments[start:], response, meta, parent=parent, routing=routing, before_commit=write)
        self._last_calls[thread] = _LastCall(tuple(segments), record.response_node, record.response.ids)
        self.calls_recorded += 1
        if self.recorded_tally is not None:
            self.recorded_tally[self.execution] = self.calls_recorded
        return record

    def _entry(self, segments: list[Segment], thread: str) -> tuple[int | None, int]:
        """(node to enter the tree at, index of the first segment below it): the thread's previous call's response
        node when `segments` extend that call, else (None, 0), the root."""
        last = self._last_calls.get(thread)
        if last is not None and _extends(segments, last):
            return last.response_node, len(last.segments) + 1
        return None, 0

    def routed_prefix_len(self, segments: Sequence[Segment], *, thread: str = "main") -> int:
        """How many leading tokens of a prompt of these segments the tree already has routing for: the
        `routed_experts_start` to ask the engine for (docs/moe.md, "Routing replay"). O(new segments)."""
        segments = list(segments)
        parent, start = self._entry(segments, thread)
        return self.tree.routed_prefix_len(segments[start:], parent=parent)

    def _write(self, record: CallRecord) -> None:
        """The call's line, written before the tree takes the call (`TrajectoryTree.insert(before_commit=)`)."""
        try:
            self.writer.append(record)
        except (OSError, RecursionError, TypeError, ValueError) as error:
            log.error("execution %s: call %s not recorded", self.execution, record.meta.request_id, exc_info=True)
            raise RecordError(
                f"the call could not be recorded ({type(error).__name__}); nothing of it was kept and the execution "
                "goes on"
            ) from error

    def begin_call(self) -> None:
        """A call of this execution was admitted (the proxy calls `end_call` when it has ended and is recorded)."""
        self.calls_in_flight += 1

    def end_call(self) -> None:
        self.calls_in_flight -= 1
        if self.closing and self.calls_in_flight == 0:
            self.close()

    def close_when_idle(self) -> None:
        """Close now, or, with calls in flight, once the last of them has ended and been recorded."""
        self.closing = True
        if self.calls_in_flight == 0:
            self.close()

    def close(self) -> None:
        if not self.tree.closed:
            self.tree.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _lru(table: OrderedDict, key: str, make: Callable[[], Any]) -> Any:
    value = table.get(key)
    if value is None:
        value = table[key] = make()
        while len(table) > MAX_THREADS:
            table.popitem(last=False)
    table.move_to_end(key)
    return value


class SessionRegistry:
    """Issues keys and holds the sessions of a run. `records_dir=None` keeps trees in memory only."""

    def __init__(
        self,
        *,
        vocab_size: int,
        make_builder: Callable[[Any], Any],
        make_payload_cache: Callable[[], Any],
        records_dir: str | Path | None = None,
    ):
        self.vocab_size = vocab_size
        self.records_dir = Path(records_dir) if records_dir is not None else None
        self._make_builder = make_builder
        self._make_payload = make_payload_cache
        self._by_key: dict[str, ExecutionSession] = {}
        self._by_execution: dict[str, ExecutionSession] = {}
        self._closed: set[str] = set()  # ids of closed executions: never issued again
        self._recorded: dict[str, int] = {}  # execution -> calls recorded, for every execution issued in the run
        self._counter = 0
        if self.records_dir is not None:
            self.records_dir.mkdir(parents=True, exist_ok=True)

    def issue(self, execution: str | None = None, *, key: str | None = None) -> ExecutionSession:
        """A new execution (named `execution`, or `exec-<n>`) with a fresh key, or with `key` (one `new_key` made
        elsewhere: a proxy shard's controller issues the keys of the executions it places on the shard).

        ValueError for an id that may not name an execution; `ExecutionIdConflict` for one that is open or was
        closed (a closed execution is never reopened: its record file is complete and final)."""
        if execution is None:
            while execution is None or execution in self._by_execution or execution in self._closed:
                execution = f"exec-{self._counter:05d}"
                self._counter += 1
        check_execution_id(execution)
        if execution in self._by_execution:
            raise ExecutionIdConflict(f"execution={execution!r} already has a key")
        if execution in self._closed:
            raise ExecutionIdConflict(
                f"execution={execution!r} was closed: a closed execution is never reopened (its record file is "
                "final); issue a new id"
            )
        if key is None:
            key = new_key()
        elif not isinstance(key, str) or not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 32:
            raise ValueError(f"key: an execution key is {KEY_PREFIX!r} and at least 32 random characters (new_key)")
        elif key in self._by_key:
            raise ExecutionIdConflict("that key is another open execution's")
        writer = None
        if self.records_dir is not None:
            writer = RecordWriter(self.records_dir / f"{execution}.jsonl", execution, self.vocab_size)
        session = ExecutionSession(
            execution=execution,
            key=key,
            tree=TrajectoryTree(execution, self.vocab_size),
            writer=writer,
            payload=self._make_payload(),
            make_builder=self._make_builder,
            recorded_tally=self._recorded,
        )
        self._recorded[execution] = 0
        self._by_key[key] = session
        self._by_execution[execution] = session
        log.debug("execution %s: key issued", execution)  # one per execution: at INFO it floods a run's console
        return session

    def by_key(self, key: str | None) -> ExecutionSession | None:
        if not key:
            return None
        return self._by_key.get(key)

    def by_execution(self, execution: str) -> ExecutionSession | None:
        return self._by_execution.get(execution)

    def calls_recorded(self) -> dict[str, int]:
        """Execution -> calls recorded so far, for every execution issued in this run, open or closed (a copy)."""
        return dict(self._recorded)

    def close(self, execution: str) -> int:
        """The execution ended: its key stops working at once, and its tree and file are closed as soon as its calls
        in flight have ended (each finishes as usual and is recorded once). Returns how many were in flight."""
        session = self._by_execution.pop(execution, None)
        if session is None:
            return 0
        self._closed.add(execution)
        self._by_key.pop(session.key, None)
        in_flight = session.calls_in_flight
        session.close_when_idle()
        return in_flight

    def close_all(self) -> None:
        """Close every execution now (at shutdown, once the proxy has stopped and its calls have ended)."""
        for execution, session in list(self._by_execution.items()):
            self.close(execution)
            session.close()
