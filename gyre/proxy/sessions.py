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

import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.traj.record import CallMeta, CallRecord, Response, Segment
from gyre.traj.store import RecordWriter
from gyre.traj.tree import TrajectoryTree

log = logging.getLogger(__name__)

KEY_PREFIX = "gyre-"
MAX_THREADS = 64  # prompt builders kept per execution (least recently used dropped)
_EXECUTION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def thread_key(signals: Mapping[str, Any]) -> str:
    """Which conversation thread of an execution a call continues: sub-agents get their own."""
    for name in ("x-claude-code-agent-id", "agent_id", "thread-id", "parent_thread_id"):
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
    last_node: dict[str, int] = field(default_factory=dict)  # thread -> response node of its last call

    def builder(self, thread: str):
        builder = self.builders.get(thread)
        if builder is None:
            builder = self.builders[thread] = self.make_builder(self.payload)
            while len(self.builders) > MAX_THREADS:
                self.builders.popitem(last=False)
        self.builders.move_to_end(thread)
        return builder

    def record(
        self,
        segments: Sequence[Segment],
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        finish_reason: str,
        meta: CallMeta,
        *,
        thread: str = "main",
    ) -> CallRecord:
        """Insert one call into the tree and append it to the record file (both or, on bad input, neither)."""
        record = self.tree.insert(segments, Response.build(output_ids, logprobs, finish_reason), meta)
        if self.writer is not None:
            self.writer.append(record)
        self.last_node[thread] = record.response_node
        return record

    def close(self) -> None:
        if not self.tree.closed:
            self.tree.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


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
        self._counter = 0
        if self.records_dir is not None:
            self.records_dir.mkdir(parents=True, exist_ok=True)

    def issue(self, execution: str | None = None) -> ExecutionSession:
        """A new execution (named `execution`, or `exec-<n>`) with a fresh key."""
        if execution is None:
            while execution is None or execution in self._by_execution:
                execution = f"exec-{self._counter:05d}"
                self._counter += 1
        if not isinstance(execution, str) or not _EXECUTION_ID.match(execution):
            raise ValueError(
                f"execution={execution!r} is not allowed: expected 1-128 characters of letters, digits, '.', '_', "
                "'-', starting with a letter or digit (it names the record file)"
            )
        if execution in self._by_execution:
            raise ValueError(f"execution={execution!r} already has a key")
        key = KEY_PREFIX + secrets.token_urlsafe(24)
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
        )
        self._by_key[key] = session
        self._by_execution[execution] = session
        log.info("execution %s: key issued", execution)
        return session

    def by_key(self, key: str | None) -> ExecutionSession | None:
        if not key:
            return None
        return self._by_key.get(key)

    def by_execution(self, execution: str) -> ExecutionSession | None:
        return self._by_execution.get(execution)

    def close(self, execution: str) -> None:
        """The execution ended: its key stops working and its tree and file are closed."""
        session = self._by_execution.pop(execution, None)
        if session is not None:
            self._by_key.pop(session.key, None)
            session.close()

    def close_all(self) -> None:
        for execution in list(self._by_execution):
            self.close(execution)

    @property
    def sessions(self) -> list[ExecutionSession]:
        return list(self._by_execution.values())
