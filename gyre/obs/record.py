"""The per-step record of a training run: what `metrics.jsonl`, W&B, the progress line and `summary.json` read.

Role
    `StepRecord` names every metric a training step reports (docs/runtime.md, "Outputs"). The runtime's
    controller fills one at each step's end and hands it to `gyre.obs.sinks.MetricsLogger`; this module only
    defines and checks it. Pure: stdlib only.

Contract
    * Times are seconds; `wall_time_s` counts from the run's start (the controller's monotonic clock at
      `Scheduler.start`) to the step's end, so step times are the differences of consecutive records, exactly as
      the simulator's `step_times_s` are differences of its step ends.
    * `step` is the scheduler's step (the trainer version the step trains, 0 first: `BeginStep(step)`), so the
      staleness warm-up (`gyre.sched.staleness.warmup_steps`) skips the same records as the simulator skips groups.
    * A metric the step could not measure is None (no group consumed: no staleness; no rollout: no reward), never
      a made-up 0; non-finite floats are written as null by the sinks.
    * `to_dict()` is flat and JSON-able: the loss metrics appear under `loss/<name>`, the transitions as a list of
      dicts, `roles` as a list of role names by cell. `record_from_dict(to_dict(r)) == r`.
    * Construction checks types and ranges and raises ValueError naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gyre.config.checks import is_int, is_number
from gyre.sched.types import Role

__all__ = ["LOSS_METRICS", "ROLES", "StepRecord", "TransitionRecord", "json_ready", "record_from_dict"]

# The detached metrics of `gyre.rl.loss.policy_loss` (Eq. 5-6; docs/loss.md), summed or averaged over a step's
# micro-steps by the trainer, plus "loss" itself (the batch loss L(theta) of Eq. 6, `StepResult.loss` summed
# over the cells that trained).
LOSS_METRICS = (
    "loss",
    "clip_fraction",
    "token_cap_fraction",
    "loss_cap_fraction",
    "seq_ratio_mean",
    "seq_ratio_min",
    "seq_ratio_max",
    "token_ratio_mean",
    "token_ratio_max",
    "abs_log_ratio_mean",
    "abs_log_ratio_max",
)

# A cell's role at the step's end: a `gyre.sched.types.Role` value (the transitional states included).
ROLES = tuple(role.value for role in Role)


@dataclass(frozen=True, kw_only=True)
class TransitionRecord:
    """One role change of a cell that ended during the step (`BeginTransition` to `transition_finished`)."""

    cell: int
    to: str  # "rollout" or "training"
    start_s: float  # seconds since the run's start
    duration_s: float
    # Where the time went (docs/runtime.md, "What happens at a transition"), seconds by phase: to training `reroute`
    # (the cell's executions moved, their KV with them), `drain`, `release`, `restore` (the trainer built or the
    # cell's ranks told); to rollout `publish_wait`, `ranks` (the cell's ranks told), `resume`, `load_weights`.
    phases: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(isinstance(self.cell, int) and not isinstance(self.cell, bool) and self.cell >= 0,
                 "transition.cell", self.cell, "an integer >= 0")  # fmt: skip
        _require(self.to in ("rollout", "training"), "transition.to", self.to, "'rollout' or 'training'")
        _require(_finite(self.start_s) and self.start_s >= 0, "transition.start_s", self.start_s, "seconds >= 0")
        _require(_finite(self.duration_s) and self.duration_s >= 0, "transition.duration_s", self.duration_s,
                 "seconds >= 0")  # fmt: skip
        _require(isinstance(self.phases, Mapping) and all(isinstance(k, str) and _finite(v) and v >= 0
                 for k, v in self.phases.items()), "transition.phases", self.phases,
                 "a mapping of phase names to seconds >= 0")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one training step reports. Fields are documented in docs/runtime.md, "Outputs"."""

    step: int
    """The scheduler's step (0 first)."""
    wall_time_s: float
    """Seconds from the run's start to this step's end (the optimizer update done)."""
    burst: int = 0
    """The burst the step belongs to (a burst ends with a publication: Eq. 3)."""
    reward_mean: float | None = None
    """Mean reward of the executions of the groups trained in this step."""
    pass_rate: float | None = None
    """Fraction of those executions whose evaluation passed."""
    loss: dict[str, float] = field(default_factory=dict)
    """The loss metrics of Eq. 5-6, keys among `LOSS_METRICS`."""
    grad_norm: float | None = None
    """Global gradient norm before clipping (the core trainer's `update()` metrics)."""
    staleness_group_mean: float | None = None
    """Mean staleness (trainer version - sampling version) over the groups consumed in this step."""
    staleness_token_mean: float | None = None
    """Token-weighted mean staleness over those groups."""
    staleness_max: float | None = None
    """Largest staleness among those groups."""
    staleness_groups: int = 0
    """Groups consumed in this step (the weights of the summary's means)."""
    staleness_tokens: float = 0.0
    """Their tokens (the weights of the summary's token mean)."""
    roles: tuple[str, ...] = ()
    """Every cell's role at the step's end, by cell index, values among `ROLES`."""
    waterlevel: float | None = None
    """The rollout waterlevel (Eq. 2) at the step's end: running executions over rollout capacity."""
    rollout_capacity: int | None = None
    """Execution slots of the engines in the rollout role at the step's end."""
    transitions: tuple[TransitionRecord, ...] = ()
    """Role changes that ended during the step."""
    reroutes: int = 0
    """Executions moved by the scheduler's `Reroute` during the step."""
    rerouted_executions: tuple[int, ...] = ()
    """The scheduler ids of those executions, one entry per move."""
    calls_rerouted: int = 0
    """Model calls that ran on more than one engine (the proxy's `rerouted` counter, this step's increase)."""
    kv_migrations: int = 0
    """Model calls whose continuation reused migrated KV (the proxy's `kv_migrated`, this step's increase)."""
    calls_reprefilled: int = 0
    """Calls in flight on a rerouted execution's old engine whose KV did not move (an engine without per-request KV
    export, SGLang's; or the call was not running): aborted there and re-prefilled on the destination."""
    training_cells: int | None = None
    """Cells whose gradients the step summed (the prefix 0..k-1 at the step's close)."""
    joined_cells: tuple[int, ...] = ()
    """Satellites admitted to the step while it was in flight (they pulled the core's weights and claimed)."""
    rollout_tokens: int = 0
    """Tokens sampled by the engines during the step."""
    train_tokens: int = 0
    """Target tokens trained in the step (`StepResult.tokens` summed over the cells)."""
    rollout_tokens_per_s: float | None = None
    """Sampled tokens per second of the step's wall time."""
    train_tokens_per_s: float | None = None
    """Trained tokens per second of the step's training time (first claim to update done)."""
    train_compute_s: float = 0.0
    """Seconds the step's cells spent in forward and backward passes, summed over the cells (`StepResult.compute_s`):
    the training part of the node-time utilization."""
    update_s: float | None = None
    """Seconds from the core's last micro-step to the step's end: the gradient reduction, the optimizer update and
    the broadcast to the satellites (`StepResult.update_s`)."""
    weight_pulls_s: tuple[float, ...] = ()
    """Seconds each satellite that joined the step spent pulling the core's weights of the step."""

    def __post_init__(self) -> None:
        _require(_count(self.step), "step", self.step, "an integer >= 0")
        _require(_count(self.burst), "burst", self.burst, "an integer >= 0")
        _require(_finite(self.wall_time_s) and self.wall_time_s >= 0, "wall_time_s", self.wall_time_s, "seconds >= 0")
        for name in ("reward_mean", "grad_norm", "staleness_group_mean", "staleness_token_mean", "staleness_max",
                     "waterlevel", "rollout_tokens_per_s", "train_tokens_per_s", "update_s"):  # fmt: skip
            value = getattr(self, name)
            _require(value is None or _number(value), name, value, "a number or None")
        _require(self.pass_rate is None or (_number(self.pass_rate) and 0 <= self.pass_rate <= 1), "pass_rate",
                 self.pass_rate, "a fraction in [0, 1] or None")  # fmt: skip
        _require(isinstance(self.loss, Mapping), "loss", self.loss, f"a mapping with keys among {LOSS_METRICS}")
        for name, value in self.loss.items():
            _require(name in LOSS_METRICS, "loss", name, f"a key among {LOSS_METRICS}")
            _require(_number(value), f"loss.{name}", value, "a number")
        for name in ("staleness_groups", "reroutes", "calls_rerouted", "kv_migrations", "calls_reprefilled",
                     "rollout_tokens", "train_tokens"):  # fmt: skip
            _require(_count(getattr(self, name)), name, getattr(self, name), "an integer >= 0")
        _require(_number(self.staleness_tokens) and self.staleness_tokens >= 0, "staleness_tokens",
                 self.staleness_tokens, "a number >= 0")  # fmt: skip
        _require(_finite(self.train_compute_s) and self.train_compute_s >= 0, "train_compute_s",
                 self.train_compute_s, "seconds >= 0")  # fmt: skip
        _require(all(_finite(s) and s >= 0 for s in self.weight_pulls_s), "weight_pulls_s", self.weight_pulls_s,
                 "seconds >= 0")  # fmt: skip
        _require(self.rollout_capacity is None or _count(self.rollout_capacity), "rollout_capacity",
                 self.rollout_capacity, "an integer >= 0 or None")  # fmt: skip
        _require(all(role in ROLES for role in self.roles), "roles", self.roles, f"role names among {ROLES}")
        _require(all(isinstance(t, TransitionRecord) for t in self.transitions), "transitions", self.transitions,
                 "TransitionRecord values")  # fmt: skip
        _require(self.training_cells is None or (_count(self.training_cells) and self.training_cells >= 1),
                 "training_cells", self.training_cells, "an integer >= 1 or None")  # fmt: skip
        _require(all(_count(c) and c >= 1 for c in self.joined_cells), "joined_cells", self.joined_cells,
                 "satellite cell indices (integers >= 1)")  # fmt: skip
        _require(all(_count(e) for e in self.rerouted_executions), "rerouted_executions", self.rerouted_executions,
                 "execution ids (integers >= 0)")  # fmt: skip
        _require(len(self.rerouted_executions) in (0, self.reroutes), "rerouted_executions",
                 self.rerouted_executions, f"empty or one entry per reroute ({self.reroutes})")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-able dict (module docstring): `loss/<name>` keys, lists for tuples."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "loss":
                out.update({f"loss/{name}": value[name] for name in LOSS_METRICS if name in value})
            elif f.name == "transitions":
                out["transitions"] = [asdict(t) for t in value]
            elif isinstance(value, tuple):
                out[f.name] = list(value)
            else:
                out[f.name] = value
        return out


def record_from_dict(data: Mapping[str, Any]) -> StepRecord:
    """The `StepRecord` that `to_dict()` wrote (a line of `metrics.jsonl` read back; null reads as None)."""
    names = {f.name for f in fields(StepRecord)}
    loss = {key.removeprefix("loss/"): value for key, value in data.items() if key.startswith("loss/")}
    unknown = sorted(key for key in data if key not in names and not key.startswith("loss/"))
    _require(not unknown, "record", unknown, f"keys among {sorted(names)}")
    kwargs: dict[str, Any] = {key: value for key, value in data.items() if key in names}
    kwargs["loss"] = loss
    kwargs["transitions"] = tuple(TransitionRecord(**t) for t in data.get("transitions", ()))
    for name in ("roles", "rerouted_executions", "joined_cells", "weight_pulls_s"):
        kwargs[name] = tuple(data.get(name, ()))
    return StepRecord(**kwargs)


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"StepRecord.{name}={value!r} is not allowed: expected {allowed}")


def _number(value: Any) -> bool:
    """An int or float, never a bool (nan and inf are allowed: a diverged loss is still reported)."""
    return is_number(value)


def _finite(value: Any) -> bool:
    return _number(value) and math.isfinite(value)


def _count(value: Any) -> bool:
    return is_int(value) and value >= 0


def json_ready(value: Any) -> Any:
    """`value` with non-finite floats replaced by None (recursively through dicts, lists and tuples), so
    `json.dumps(..., allow_nan=False)` writes strict JSON, as the simulator's app writes its summary."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value
