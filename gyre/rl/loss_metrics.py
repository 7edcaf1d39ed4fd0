"""The metrics of `gyre.rl.loss.policy_loss` combined over a step's micro-steps and the cells that trained it
(docs/loss.md, "Metrics").

`LossMetricSums.add(metrics)` takes one call's metrics; `merge(other)` adds another cell's sums; `means()` is the
step's metrics: each fraction and mean weighted by its own denominator (the token statistics by `num_targets`,
the execution statistics by `num_executions_with_targets`), minima and maxima over the calls, and nothing for a
step without targets (absent, not zero). `to_dict()` / `from_dict()` carry the sums through the job's store as
JSON. Pure: stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["EXECUTION_WEIGHTED", "MAXIMA", "MINIMA", "TOKEN_WEIGHTED", "LossMetricSums"]

TOKEN_WEIGHTED = ("token_cap_fraction", "loss_cap_fraction", "token_ratio_mean", "abs_log_ratio_mean")
EXECUTION_WEIGHTED = ("clip_fraction", "seq_ratio_mean")
MINIMA = ("seq_ratio_min",)
MAXIMA = ("seq_ratio_max", "token_ratio_max", "abs_log_ratio_max")


@dataclass
class LossMetricSums:
    """Weighted sums of one step's `policy_loss` metrics (module docstring)."""

    targets: float = 0.0  # target tokens over the calls
    executions: float = 0.0  # executions with targets, counted per call (a split execution once per part)
    sums: dict[str, float] = field(default_factory=dict)  # a weighted metric -> sum of value * its weight
    extremes: dict[str, float] = field(default_factory=dict)  # a min or max metric -> its extreme so far

    def add(self, metrics: Mapping[str, float]) -> None:
        """One call's metrics (`policy_loss`'s second value); a call without targets adds nothing."""
        targets, executions = float(metrics["num_targets"]), float(metrics["num_executions_with_targets"])
        if targets <= 0:
            return
        self.targets += targets
        self.executions += executions
        for name in TOKEN_WEIGHTED:
            self.sums[name] = self.sums.get(name, 0.0) + float(metrics[name]) * targets
        for name in EXECUTION_WEIGHTED:
            self.sums[name] = self.sums.get(name, 0.0) + float(metrics[name]) * executions
        for names, pick in ((MINIMA, min), (MAXIMA, max)):
            for name in names:
                value = float(metrics[name])
                self.extremes[name] = pick(self.extremes[name], value) if name in self.extremes else value

    def merge(self, other: LossMetricSums) -> None:
        """Add another part's sums (another cell's share of the step)."""
        self.targets += other.targets
        self.executions += other.executions
        for name, value in other.sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        for names, pick in ((MINIMA, min), (MAXIMA, max)):
            for name in names:
                if name in other.extremes:
                    mine = self.extremes.get(name)
                    self.extremes[name] = other.extremes[name] if mine is None else pick(mine, other.extremes[name])

    def means(self) -> dict[str, float]:
        """The step's metrics (names of `TOKEN_WEIGHTED`, `EXECUTION_WEIGHTED`, `MINIMA`, `MAXIMA`); empty without
        targets. A non-finite value (an overflowed ratio) is left out, not reported."""
        if self.targets <= 0:
            return {}
        out = {name: self.sums[name] / self.targets for name in TOKEN_WEIGHTED}
        if self.executions > 0:
            out.update({name: self.sums[name] / self.executions for name in EXECUTION_WEIGHTED})
        out.update(self.extremes)
        return {name: value for name, value in out.items() if math.isfinite(value)}

    def to_dict(self) -> dict:
        return {"targets": self.targets, "executions": self.executions, "sums": self.sums, "extremes": self.extremes}

    @classmethod
    def from_dict(cls, data: Mapping) -> LossMetricSums:
        return cls(
            targets=float(data["targets"]),
            executions=float(data["executions"]),
            sums={str(k): float(v) for k, v in data["sums"].items()},
            extremes={str(k): float(v) for k, v in data["extremes"].items()},
        )
