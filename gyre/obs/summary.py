"""`summary.json` of a training run, with the simulator's keys, so real and simulated runs compare field for field.

Role
    `build_summary` makes, from the run's `gyre.obs.record.StepRecord`s (and the scheduler's counters at the end),
    the dict `gyre.sim.simulator.summarize` makes from a simulation: the same keys at every level
    (docs/runtime.md, "Outputs"). `write_summary` writes it atomically. `build_summary` is pure.

Contract
    * `total_time_s` is the last record's `wall_time_s` (the run's start is 0, as the simulator's clock);
      `step_times_s` the differences of consecutive `wall_time_s` from 0; `steps` the number of records.
    * `staleness`: `group_mean` and `token_mean` over the records with `step >= warmup_steps`, weighted by their
      `staleness_groups` and `staleness_tokens` (so they equal the scheduler's `StalenessLog.summary(skip_steps=)`
      over the same groups); `max` and `group_mean_all_steps` over every record; `groups_counted` the groups after
      the warm-up; `target` as given (None under continuous dispatch, as the simulator writes it).
    * `transitions`: the transitions recorded; `reroutes.total` the reroutes recorded, `executions` the distinct
      `rerouted_executions`, `max_per_execution_in_a_burst` the most moves of one execution within one burst.
    * `utilization` as the caller measured it (the program: every cell's load from its trace and the records'
      `train_compute_s`, docs/runtime.md "Outputs"), null when not passed; `counters` / `outcomes` null when the
      caller does not pass the scheduler's (`Scheduler.d`, `.p`, `.f`, `.outcomes`); a mean over no groups is null
      (the simulator's NaN, which its app writes as null).
    * `write_summary(path, summary)` writes strict JSON (non-finite floats as null) to a temporary file in the same
      directory, fsyncs it and renames it over `path`, so a reader sees the old file or the new one, never half.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gyre.obs.record import StepRecord, json_ready

__all__ = ["SUMMARY_FILE", "build_summary", "write_summary"]

SUMMARY_FILE = "summary.json"


def build_summary(
    records: Sequence[StepRecord],
    *,
    experiment: str,
    mode: str,
    phi: float,
    mu: int,
    target_staleness: float | None,
    warmup_steps: int,
    counters: Mapping[str, int] | None = None,
    outcomes: Mapping[str, int] | None = None,
    utilization: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The simulator's summary keys from the records of a real run (module docstring). `counters`: the scheduler's
    `{"dispatched": d, "started": p, "finished": f}`; `outcomes`: its `outcomes` counter by Outcome value;
    `utilization`: `{"rollout", "training", "idle"}` node-time fractions the caller measured."""
    steps = [r.step for r in records]
    if steps != sorted(set(steps)):
        raise ValueError(f"build_summary records={steps!r} is not allowed: expected steps in increasing order")
    if counters is not None and set(counters) - {"redispatched"} != {"dispatched", "started", "finished"}:
        raise ValueError(
            f"build_summary counters={dict(counters)!r} is not allowed: expected keys dispatched, started, finished"
        )
    ends = [r.wall_time_s for r in records]
    total = ends[-1] if ends else 0.0
    steady = [r for r in records if r.step >= warmup_steps]
    moves = Counter((r.burst, execution) for r in records for execution in r.rerouted_executions)
    return {
        "experiment": experiment,
        "mode": mode,
        "phi": phi,
        "mu": mu,
        "total_time_s": total,
        "total_time_h": total / 3600.0,
        "steps": len(records),
        "step_times_s": [b - a for a, b in itertools.pairwise([0.0, *ends])],
        "staleness": {
            "target": target_staleness,
            "group_mean": _group_mean(steady),
            "token_mean": _token_mean(steady),
            "max": max((r.staleness_max for r in records if r.staleness_max is not None), default=None),
            "group_mean_all_steps": _group_mean(records),
            "groups_counted": sum(r.staleness_groups for r in steady),
            "warmup_steps": warmup_steps,
        },
        "utilization": dict(utilization)
        if utilization is not None
        else {"rollout": None, "training": None, "idle": None},
        "counters": dict(counters) if counters is not None else {"dispatched": None, "started": None, "finished": None},
        "outcomes": dict(outcomes) if outcomes is not None else None,
        "transitions": sum(len(r.transitions) for r in records),
        "reroutes": {
            "total": sum(r.reroutes for r in records),
            "executions": len({execution for _, execution in moves}),
            "max_per_execution_in_a_burst": max(moves.values(), default=0),
        },
    }


def _group_mean(records: Sequence[StepRecord]) -> float | None:
    weighted = [(r.staleness_group_mean, r.staleness_groups) for r in records if r.staleness_groups > 0]
    groups = sum(n for _, n in weighted)
    if groups == 0 or any(mean is None for mean, _ in weighted):
        return None
    return sum(mean * n for mean, n in weighted) / groups


def _token_mean(records: Sequence[StepRecord]) -> float | None:
    weighted = [(r.staleness_token_mean, r.staleness_tokens) for r in records if r.staleness_tokens > 0]
    tokens = sum(t for _, t in weighted)
    if tokens <= 0 or any(mean is None for mean, _ in weighted):
        return None
    return sum(mean * t for mean, t in weighted) / tokens


def write_summary(path: str | os.PathLike, summary: Mapping[str, Any]) -> Path:
    """Write `summary` as indented strict JSON to `path` atomically (module docstring); returns the path."""
    path = Path(path)
    text = json.dumps(json_ready(summary), indent=2, allow_nan=False) + "\n"
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path
