"""Sampling execution durations and outcomes for the simulator from a `WorkloadConfig`.

A group is sampled at once, so its executions share the per-query factor (Eq.-free model; see
`gyre.config.workload` for the parameters and docs/simulator.md for the calibration).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre.config.checks import ConfigError
from gyre.config.workload import WorkloadConfig
from gyre.sched import Outcome
from gyre.sim.durations import budgeted_duration

_OUTCOMES = {
    "ok": Outcome.COMPLETED,
    "completed": Outcome.COMPLETED,
    "harness_timeout": Outcome.HARNESS_TIMEOUT,
    "overall_timeout": Outcome.OVERALL_TIMEOUT,
    "failed": Outcome.FAILED,
}


@dataclass(frozen=True)
class ExecutionPlan:
    duration_s: float
    outcome: Outcome
    tokens: float


class DurationModel:
    def __init__(self, cfg: WorkloadConfig, seed: int) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self._replay: list[list[tuple[float, Outcome]]] = []
        self._next_query = 0
        if cfg.distribution == "replay":
            self._replay = read_replay_csv(cfg.replay_csv)

    def sample_group(self, size: int) -> list[ExecutionPlan]:
        if self._replay:
            return self._sample_replay(size)
        cfg, rng = self.cfg, self.rng
        factor = math.exp(cfg.query_sigma * rng.standard_normal())
        if cfg.distribution == "mixture" and rng.random() < cfg.tail_fraction:
            factor *= cfg.tail_factor
        raw = cfg.median_s * factor * np.exp(cfg.sigma * rng.standard_normal(size))
        fail_u = rng.random(size)
        overall_u = rng.random(size)
        point_u = rng.random(size)
        evals = rng.exponential(cfg.eval_s, size) if cfg.eval_s > 0 else np.zeros(size)
        plans = []
        for i in range(size):
            if fail_u[i] < cfg.failure_rate:
                duration, outcome = raw[i] * point_u[i], Outcome.FAILED
            else:
                duration, label = budgeted_duration(
                    float(raw[i]),
                    float(evals[i]),
                    float(overall_u[i]),
                    harness_s=cfg.harness_timeout_s,
                    overall_s=cfg.overall_timeout_s,
                    overall_share=cfg.overall_timeout_share,
                )
                outcome = _OUTCOMES[label]
            plans.append(ExecutionPlan(float(duration), outcome, float(duration) * cfg.tokens_per_s))
        return plans

    def _sample_replay(self, size: int) -> list[ExecutionPlan]:
        if self.cfg.replay_order == "sequence":  # the i-th group gets the i-th query, its rows in order
            rows = self._replay[self._next_query % len(self._replay)]
            self._next_query += 1
            picks = np.arange(size) % len(rows)
        else:
            rows = self._replay[self.rng.integers(len(self._replay))]
            picks = self.rng.integers(len(rows), size=size)
        return [ExecutionPlan(rows[i][0], rows[i][1], rows[i][0] * self.cfg.tokens_per_s) for i in picks.tolist()]


def read_replay_csv(path: str) -> list[list[tuple[float, Outcome]]]:
    """Rows of (duration_s, outcome), grouped by the optional `query` column (one group if absent)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"workload.replay_csv={path!r} is not allowed: expected an existing CSV file")
    groups: dict[str, list[tuple[float, Outcome]]] = {}
    with file.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames or "duration_s" not in reader.fieldnames:
            raise ConfigError(
                f"workload.replay_csv={path!r} is not allowed: expected a header with a duration_s column, "
                f"got {reader.fieldnames}"
            )
        for line, row in enumerate(reader, start=2):
            try:
                duration = float(row["duration_s"])
            except ValueError:
                duration = float("nan")
            if not math.isfinite(duration) or duration < 0:
                raise ConfigError(
                    f"workload.replay_csv={path!r} line {line}: duration_s={row['duration_s']!r} is not allowed: "
                    "expected a number >= 0"
                )
            label = (row.get("outcome") or "ok").strip().lower()
            if label not in _OUTCOMES:
                raise ConfigError(
                    f"workload.replay_csv={path!r} line {line}: outcome={label!r} is not allowed: expected one of "
                    f"{', '.join(sorted(_OUTCOMES))}"
                )
            groups.setdefault(row.get("query") or "", []).append((duration, _OUTCOMES[label]))
    if not groups:
        raise ConfigError(f"workload.replay_csv={path!r} is not allowed: expected at least one row")
    return list(groups.values())
