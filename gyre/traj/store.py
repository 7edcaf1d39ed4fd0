"""The on-disk record format (`docs/record-format.md`): one append-only JSONL file per execution.

Role: persist every model call as it completes and rebuild the identical trajectory tree later
(inspect, training buffers, resume after the controller dies).

Contract:
- Line 1 is a header `{"v": 1, "kind": "execution", "execution": ..., "vocab_size": ...}`; every
  further line is one call `{"v": 1, "kind": "call", ...}` holding only what is new for the tree:
  the node the context extends (`parent`), the segments not stored before, the response and the
  metadata. Node ids are deterministic in insertion order, so lines must be appended in the order
  the calls were inserted (the writer is called right after `TrajectoryTree.insert`).
- `load_tree` replays the lines through `TrajectoryTree.insert` and yields a tree identical to the
  one that wrote them (same node ids, same calls). A bad line raises ValueError naming file:line.
- Call indices must run 0, 1, 2, ... : a gap or a repeat means a lost or duplicated record
  (DESIGN.md contract 3) and is an error.
- A torn final line (no newline: the writer died mid-line) is skipped with a warning, so a crash
  loses at most the call being written, never the execution.

Why one file per execution: executions live for hours and close independently; a finished
execution's file is complete and immutable, can be read, shipped or deleted on its own, and node
ids (which `parent` refers to) are per-execution. Every line still names its execution so a stray
line is detected.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from gyre.traj.record import CallMeta, CallRecord, Provenance, Response, Segment
from gyre.traj.tree import TrajectoryTree

FORMAT_VERSION = 1

log = logging.getLogger(__name__)


def header_line(execution: str, vocab_size: int) -> str:
    return _dumps({"v": FORMAT_VERSION, "kind": "execution", "execution": execution, "vocab_size": vocab_size})


def call_line(record: CallRecord) -> str:
    """One call as a JSON line (no trailing newline)."""
    meta, response = record.meta, record.response
    return _dumps(
        {
            "v": FORMAT_VERSION,
            "kind": "call",
            "execution": meta.execution,
            "call": record.index,
            "parent": record.parent,
            "segments": [{"p": segment.provenance.label, "ids": segment.ids.tolist()} for segment in record.segments],
            "response": {
                "ids": response.ids.tolist(),
                "logprobs": response.logprobs.tolist(),
                "finish": response.finish_reason,
            },
            "request_id": meta.request_id,
            "policy_version": meta.policy_version,
            "engine": meta.engine,
            "timings": dict(meta.timings),
            "role_signals": dict(meta.role_signals),
        }
    )


def _dumps(obj: dict[str, Any]) -> str:
    # allow_nan=False: a NaN can never reach disk (the tree rejects it before a record exists).
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


class RecordWriter:
    """Appends calls of one execution to its file; writes the header when the file is new.

    Each call is one `write` of a full line followed by a flush, so a reader sees whole lines only
    (a crash can at worst leave one torn final line, which `load_tree` reports).
    """

    def __init__(self, path: str | Path, execution: str, vocab_size: int) -> None:
        self.path = Path(path)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        if not fresh:
            header = next(_lines(self.path))[1]
            if header.get("execution") != execution or header.get("vocab_size") != vocab_size:
                raise ValueError(
                    f"{self.path} records execution {header.get('execution')!r} (vocab_size "
                    f"{header.get('vocab_size')}); cannot append execution {execution!r} (vocab_size {vocab_size})"
                )
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        if fresh:
            self._write(header_line(execution, vocab_size))

    def append(self, record: CallRecord) -> None:
        self._write(call_line(record))

    def _write(self, line: str) -> None:
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("r", encoding="utf-8") as file:
        for lineno, text in enumerate(file, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                if not text.endswith("\n"):  # only the last line can lack its newline
                    # The writer died mid-line: that call was never completely recorded. Keep every
                    # complete call rather than lose the execution (as if the crash came a moment earlier).
                    log.warning("%s:%d: torn final line skipped (the writer stopped mid-line)", path, lineno)
                    return
                raise ValueError(f"{path}:{lineno}: not valid JSON: {err.msg}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            if obj.get("v") != FORMAT_VERSION:
                raise ValueError(f"{path}:{lineno}: record format version {obj.get('v')!r}; expected {FORMAT_VERSION}")
            yield lineno, obj


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"{where}: field {name!r} = {value!r} is missing or has the wrong type")
    return value


def parse_call(obj: dict[str, Any], where: str) -> tuple[int, int, list[Segment], Response, CallMeta]:
    """(call index, parent, new segments, response, meta) from one call line's object."""
    index = _field(obj, "call", int, where)
    parent = _field(obj, "parent", int, where)
    segments = []
    for position, raw in enumerate(_field(obj, "segments", list, where)):
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: segments[{position}] is not an object")
        provenance = Provenance.from_label(_field(raw, "p", str, f"{where}: segments[{position}]"))
        segments.append(Segment(provenance, _field(raw, "ids", list, f"{where}: segments[{position}]")))
    raw_response = _field(obj, "response", dict, where)
    response = Response.build(
        _field(raw_response, "ids", list, f"{where}: response"),
        _field(raw_response, "logprobs", list, f"{where}: response"),
        _field(raw_response, "finish", str, f"{where}: response"),
    )
    meta = CallMeta(
        execution=_field(obj, "execution", str, where),
        request_id=_field(obj, "request_id", str, where),
        policy_version=_field(obj, "policy_version", int, where),
        engine=_field(obj, "engine", str, where),
        timings=_field(obj, "timings", dict, where),
        role_signals=_field(obj, "role_signals", dict, where),
    )
    return index, parent, segments, response, meta


def load_tree(path: str | Path) -> TrajectoryTree:
    """Replay one execution's file into its trajectory tree. ValueError (file:line) on any bad line."""
    path = Path(path)
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise ValueError(f"{path}: empty file; expected a header line")
    lineno, header = first
    if header.get("kind") != "execution":
        raise ValueError(f"{path}:{lineno}: first line must be the execution header, got kind {header.get('kind')!r}")
    where = f"{path}:{lineno}"
    tree = TrajectoryTree(_field(header, "execution", str, where), _field(header, "vocab_size", int, where))
    for lineno, obj in lines:
        where = f"{path}:{lineno}"
        if obj.get("kind") != "call":
            raise ValueError(f"{where}: expected kind 'call', got {obj.get('kind')!r}")
        try:
            index, parent, segments, response, meta = parse_call(obj, where)
            if index != len(tree.calls):
                raise ValueError(f"call index {index}, expected {len(tree.calls)} (a record is lost or duplicated)")
            tree.insert(segments, response, meta, parent=parent)
        except (ValueError, TypeError) as err:
            message = str(err)
            raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None
    return tree
