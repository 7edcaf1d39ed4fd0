"""Metric sinks of a training run: one `MetricSink` protocol, JSONL, W&B and in-memory sinks, and the fan-out.

Role
    The runtime's controller hands one `gyre.obs.record.StepRecord` per step to a `MetricsLogger`, which writes it
    to every configured sink (docs/runtime.md, "Outputs"). This is the only module of gyre that imports wandb, and
    only when `logging.wandb` is not `disabled` (docs/architecture.md, "Import rules").

Contract
    * `MetricSink`: `write(record)` once per step, in step order; `close()` once, idempotent.
    * `JsonlSink(path)`: appends one strict-JSON line per record (`StepRecord.to_dict()`, non-finite floats as
      null) and flushes and fsyncs it before `write` returns, so every line written survives a crash of the run.
      A line is written with one `write` call; a partial last line (a crash mid-write) is cut off when the file
      is opened again, so every line of the file parses. A failed write raises `MetricsWriteError` naming the
      file, the step and the OS error, and the sink refuses further writes (the line may be partial on disk).
    * `WandbSink`: `wandb.init(mode=, dir=<run dir>, project=, entity=, name=, group=, tags=, config=)` at
      construction; each record is logged at `step=record.step` with its numbers only (None dropped; roles as
      per-role counts, transitions as count, total and max duration); `close()` calls `run.finish()` and
      `wandb.teardown()` (the service process ends with the run, not at interpreter exit). Offline mode needs no
      network and writes under `<run dir>/wandb`. Without the wandb package it raises `MetricsSinkError` saying how
      to fix it.
    * One W&B run per run directory: the first sink in a run directory writes its W&B run id to
      `<run dir>/wandb_run_id` (fsynced, replaced atomically); a sink started in a directory that has one (a
      resumed run) passes `id=<that id>, resume="allow"`, so the W&B run goes on. Offline, wandb 0.31 writes each
      part to its own `wandb/offline-run-<time>-<id>` directory, both under the one run id (tested). A file that
      holds no valid id is a `MetricsSinkError` naming it (remove it for a new W&B run).
    * `MemorySink`: keeps the records in a list (tests, and the summary at the end of a run).
    * `MetricsLogger(sinks)`: writes each record to every sink in order; `close()` closes every sink even when one
      fails, then raises the first failure. `build_metrics_logger(config, run_dir)` makes the sinks a
      `LoggingConfig` asks for, a `MemorySink` always first (`logger.memory`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from gyre.config.obs import WANDB_MODES, LoggingConfig
from gyre.obs.record import StepRecord, json_ready

__all__ = [
    "METRICS_FILE",
    "WANDB_RUN_ID_FILE",
    "JsonlSink",
    "MemorySink",
    "MetricSink",
    "MetricsLogger",
    "MetricsSinkError",
    "MetricsWriteError",
    "WandbSink",
    "build_metrics_logger",
    "wandb_numbers",
]

METRICS_FILE = "metrics.jsonl"
WANDB_RUN_ID_FILE = "wandb_run_id"
_WANDB_ID_RESERVED = ":;,#?/'"  # characters wandb 0.31 refuses in a run id (wandb_settings.validate_run_id)


class MetricsSinkError(RuntimeError):
    """A sink could not be set up (a missing package, a bad run directory)."""


class MetricsWriteError(OSError):
    """A metrics line could not be written; the message names the file, the step and the OS error."""


@runtime_checkable
class MetricSink(Protocol):
    def write(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps every record written, in order."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.closed = False

    def write(self, record: StepRecord) -> None:
        if self.closed:
            raise MetricsSinkError(f"MemorySink is closed; step {record.step} was not recorded")
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


class JsonlSink:
    """One JSON line per step appended to `path`, flushed and fsynced before `write` returns (module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.is_file():
            _cut_partial_line(self.path)
        try:
            self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held until close)
        except OSError as error:
            raise MetricsSinkError(f"cannot open the metrics file {self.path}: {error}") from error

    def write(self, record: StepRecord) -> None:
        if self._file is None:
            raise MetricsWriteError(f"{self.path}: the sink is closed (or a write failed); step {record.step} lost")
        line = json.dumps(json_ready(record.to_dict()), allow_nan=False, separators=(",", ":")) + "\n"
        try:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as error:
            self._abandon()
            message = f"{self.path}: could not write the metrics of step {record.step}: {error}"
            raise MetricsWriteError(message) from error

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def _abandon(self) -> None:
        """Drop the file after a failed write; closing may fail again on the same buffered bytes."""
        file, self._file = self._file, None
        with contextlib.suppress(OSError):  # the write's error is the one raised; this one repeats it
            file.close()


def _cut_partial_line(path: Path) -> None:
    """Truncate `path` after its last newline: a line cut by a crash is dropped, the complete ones stay."""
    with open(path, "rb+") as file:
        size = file.seek(0, os.SEEK_END)
        if size == 0:
            return
        file.seek(size - 1)
        if file.read(1) == b"\n":
            return
        end = size
        while end > 0:
            start = max(0, end - 65536)
            file.seek(start)
            chunk = file.read(end - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                file.truncate(start + newline + 1)
                return
            end = start
        file.truncate(0)


def wandb_numbers(record: StepRecord) -> dict[str, float | int]:
    """The numbers W&B logs for `record` (module docstring): scalars, per-role counts, transition totals."""
    data = record.to_dict()
    out: dict[str, float | int] = {}
    for key, value in data.items():
        if key in ("step", "roles", "transitions", "rerouted_executions", "joined_cells", "weight_pulls_s"):
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
    for role, count in Counter(record.roles).items():
        out[f"roles/{role}"] = count
    durations = [t.duration_s for t in record.transitions]
    out["transitions/count"] = len(durations)
    out["joins/count"] = len(record.joined_cells)
    if durations:
        out["transitions/duration_s_total"] = sum(durations)
        out["transitions/duration_s_max"] = max(durations)
    return out


class WandbSink:
    """A W&B run in `run_dir` (module docstring). wandb is imported here, at construction, and nowhere else."""

    def __init__(
        self,
        *,
        mode: str,
        run_dir: str | os.PathLike,
        project: str,
        entity: str = "",
        name: str = "",
        group: str = "",
        tags: Sequence[str] = (),
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if mode not in ("offline", "online"):
            raise ValueError(f"WandbSink mode={mode!r} is not allowed: expected 'offline' or 'online'")
        try:
            import wandb
        except ImportError as error:
            raise MetricsSinkError(
                f"logging.wandb={mode} needs the wandb package ({error}); install it (pip install wandb) or set "
                "logging.wandb=disabled"
            ) from error
        run_dir = Path(run_dir)
        id_file = run_dir / WANDB_RUN_ID_FILE
        resumed_id = _read_wandb_run_id(id_file)
        resume = {"id": resumed_id, "resume": "allow"} if resumed_id is not None else {}
        self._run: Any = wandb.init(
            mode=mode,
            dir=str(run_dir),
            project=project,
            entity=entity or None,
            name=name or run_dir.name,
            group=group or None,
            tags=list(tags) or None,
            config=dict(config) if config is not None else None,
            **resume,
        )
        self.run_id: str = self._run.id
        if resumed_id is None:
            try:
                _write_wandb_run_id(id_file, self.run_id)
            except OSError as error:
                self.close()
                raise MetricsSinkError(f"cannot write the W&B run id to {id_file}: {error}") from error

    def write(self, record: StepRecord) -> None:
        if self._run is None:
            raise MetricsSinkError(f"WandbSink is closed; step {record.step} was not logged")
        self._run.log(wandb_numbers(record), step=record.step)

    def close(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
            # And its service process (wandb-core), now rather than at interpreter exit: a worker forked from a
            # forkserver leaves by os._exit (no atexit), and wandb-core, which holds the job's stdout, then lived
            # until it noticed its parent gone (15 s under load: a Ctrl-C whose exit took 16 s, measured).
            import wandb

            wandb.teardown()


def _read_wandb_run_id(path: Path) -> str | None:
    """The W&B run id a previous part of this run wrote to `path`, or None when there is no such file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as error:
        raise MetricsSinkError(f"cannot read the W&B run id in {path}: {error}") from error
    run_id = text.strip()
    if not run_id or any(c.isspace() or c in _WANDB_ID_RESERVED for c in run_id):
        raise MetricsSinkError(
            f"{path} holds {text[:80]!r}, not a W&B run id (non-empty, no whitespace, none of {_WANDB_ID_RESERVED}); "
            "remove the file to start a new W&B run"
        )
    return run_id


def _write_wandb_run_id(path: Path, run_id: str) -> None:
    """Write `run_id` to `path` whole or not at all: a temporary file, fsynced, then renamed over it."""
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "w", encoding="utf-8") as file:
        file.write(run_id + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, path)


class MetricsLogger:
    """Writes each record to every sink; `memory` is the first `MemorySink` among them (or None)."""

    def __init__(self, sinks: Iterable[MetricSink]) -> None:
        self.sinks = list(sinks)
        for sink in self.sinks:
            if not isinstance(sink, MetricSink):
                raise TypeError(f"MetricsLogger sink {sink!r} is not allowed: expected write(record) and close()")
        self.memory = next((s for s in self.sinks if isinstance(s, MemorySink)), None)
        self._last_step: int | None = None

    def write(self, record: StepRecord) -> None:
        if not isinstance(record, StepRecord):
            raise TypeError(f"MetricsLogger.write record={record!r} is not allowed: expected a StepRecord")
        if self._last_step is not None and record.step <= self._last_step:
            raise ValueError(
                f"MetricsLogger.write step={record.step} is not allowed: expected a step after {self._last_step}"
            )
        self._last_step = record.step
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as error:  # every sink gets closed; the first failure is raised below
                first = first or error
        if first is not None:
            raise first

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_metrics_logger(
    config: LoggingConfig, run_dir: str | os.PathLike, *, run_config: Mapping[str, Any] | None = None
) -> MetricsLogger:
    """The sinks `config` asks for in `run_dir` (created if missing): memory, then metrics.jsonl, then W&B.
    `run_config` (the resolved config as plain data) is W&B's run config."""
    if config.wandb not in WANDB_MODES:
        raise ValueError(f"logging.wandb={config.wandb!r} is not allowed: expected one of {WANDB_MODES}")
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MetricsSinkError(f"cannot create the run directory {run_dir}: {error}") from error
    sinks: list[MetricSink] = [MemorySink()]
    if config.metrics_jsonl:
        sinks.append(JsonlSink(run_dir / METRICS_FILE))
    if config.wandb != "disabled":
        try:
            sinks.append(
                WandbSink(
                    mode=config.wandb,
                    run_dir=run_dir,
                    project=config.wandb_project,
                    entity=config.wandb_entity,
                    name=config.wandb_name,
                    group=config.wandb_group,
                    tags=config.wandb_tags,
                    config=run_config,
                )
            )
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
    return MetricsLogger(sinks)
