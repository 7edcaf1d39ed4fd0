"""Execution-duration model of a workload, for the simulator.

An execution's raw duration is log-normal: a per-query factor (queries differ in difficulty, so the
N executions of a group are correlated) times a per-execution factor. `mixture` adds a heavy tail:
a fraction of queries is `tail_factor` times slower. A harness timeout is a ceiling: an execution
that would run past it ends there (clustered just after it by the evaluation time) and is still
scored. An over-budget execution that the harness does not stop (a share of them: a hung tool, a
stuck evaluation) exhausts the overall budget instead and is discarded, so both kinds of timeout
cluster in the slow queries. A fraction of executions fails totally and becomes a zero-reward
placeholder. `replay` draws durations from a CSV instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config.checks import require, require_choice, require_duration, require_number

DISTRIBUTIONS = ("lognormal", "mixture", "replay")


@dataclass(kw_only=True)
class WorkloadConfig:
    name: str = "default"
    """Label for summaries and plots."""
    distribution: str = "lognormal"
    """lognormal | mixture (lognormal with a slow fraction of queries) | replay (CSV of durations)."""
    median_s: float = 3600.0
    """Median raw execution duration in seconds."""
    sigma: float = 0.6
    """Log-space standard deviation of the per-execution factor."""
    query_sigma: float = 0.4
    """Log-space standard deviation of the per-query factor shared by a group's executions."""
    tail_fraction: float = 0.0
    """mixture: fraction of queries in the slow component."""
    tail_factor: float = 3.0
    """mixture: duration multiplier of the slow component."""
    harness_timeout_s: float = 0.0
    """The harness's own budget (0: none). Executions reaching it end there and are still scored."""
    eval_s: float = 60.0
    """Mean evaluation time after an execution ends (exponential); spreads the clustered timeouts."""
    overall_timeout_s: float = 0.0
    """The overall budget (0: none). Executions exhausting it get no valid reward and are discarded."""
    overall_timeout_share: float = 0.0
    """Share of over-budget executions (raw duration past harness_timeout_s) that exhaust the overall
    budget instead of being stopped by the harness; without a harness budget, every execution past
    overall_timeout_s does. The overall-timeout rate is P(raw > harness_timeout_s) * share."""
    failure_rate: float = 0.0
    """Fraction of executions that fail totally (zero-reward placeholder), at a uniform point of their run."""
    tokens_per_s: float = 100.0
    """Tokens an execution processes per second; weights the token-weighted staleness."""
    replay_order: str = "sample"
    """replay: `sample` draws a random query per group and random rows of it (with replacement); `sequence` gives
    the i-th dispatched group the i-th query of the CSV, its rows in order (a real run replayed as it happened;
    cycling when the CSV runs out)."""
    replay_csv: str = ""
    """replay: path of a CSV with a `duration_s` column (optional `outcome`: ok|harness_timeout|
    overall_timeout|failed, optional `query` to keep a group's executions together)."""

    def __post_init__(self) -> None:
        require_choice("workload.distribution", self.distribution, DISTRIBUTIONS)
        require_duration("workload.median_s", self.median_s)
        require_number("workload.sigma", self.sigma, ge=0)
        require_number("workload.query_sigma", self.query_sigma, ge=0)
        require_number("workload.tail_fraction", self.tail_fraction, ge=0, lt=1)
        require_number("workload.tail_factor", self.tail_factor, ge=1)
        if self.distribution == "mixture":
            require(self.tail_fraction > 0, "workload.tail_fraction", self.tail_fraction, "> 0 for a mixture")
        require_duration("workload.harness_timeout_s", self.harness_timeout_s, allow_zero=True, note="0: none")
        require_duration("workload.eval_s", self.eval_s, allow_zero=True)
        require_duration("workload.overall_timeout_s", self.overall_timeout_s, allow_zero=True, note="0: none")
        if self.overall_timeout_s and self.harness_timeout_s:
            require(
                self.overall_timeout_s > self.harness_timeout_s,
                "workload.overall_timeout_s",
                self.overall_timeout_s,
                f"more than workload.harness_timeout_s ({self.harness_timeout_s:g})",
            )
        require_number("workload.overall_timeout_share", self.overall_timeout_share, ge=0, le=1)
        require_number("workload.failure_rate", self.failure_rate, ge=0, lt=1)
        if self.overall_timeout_share > 0:
            require(
                self.overall_timeout_s > 0 and self.harness_timeout_s > 0,
                "workload.overall_timeout_share",
                self.overall_timeout_share,
                "0 unless both workload.harness_timeout_s and workload.overall_timeout_s are set",
            )
        require_number("workload.tokens_per_s", self.tokens_per_s, gt=0)
        require_choice("workload.replay_order", self.replay_order, ("sample", "sequence"))
        if self.distribution == "replay":
            require(bool(self.replay_csv), "workload.replay_csv", self.replay_csv, "a CSV path for replay")
