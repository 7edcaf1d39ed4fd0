"""Vocabulary of the scheduler: roles, outcomes, the spec it runs under, and the actions it returns.

Actions are plain frozen dataclasses; a driver (the simulator, or the runtime's controller) carries
them out and reports back through the scheduler's event methods.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

POOL = -1
"""Engine id of the separate rollout pool; cells are engines 0..K-1 (core first)."""


class Role(enum.Enum):
    ROLLOUT = "rollout"
    TO_TRAINING = "to_training"
    TRAINING = "training"
    TO_ROLLOUT = "to_rollout"


class Outcome(enum.Enum):
    """How an execution closed. Every outcome advances f; only request-level retries touch no counter."""

    COMPLETED = "completed"  # finished and evaluated: valid reward
    HARNESS_TIMEOUT = "harness_timeout"  # the harness's budget ran out; preserved work is scored: valid
    OVERALL_TIMEOUT = "overall_timeout"  # the overall budget ran out: no valid reward, discarded
    FAILED = "failed"  # total failure: a zero-reward placeholder keeps the group complete
    CANCELLED = "cancelled"  # surplus under oversampling

    @property
    def closes_group_slot(self) -> bool:
        """Counts toward the N closed executions a group needs (valid outcome or placeholder)."""
        return self in (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT, Outcome.FAILED)


MODES = ("elastic", "colocate", "async")


@dataclass(frozen=True, kw_only=True)
class SchedSpec:
    """Everything the policy needs to know about the cluster and the RL schedule."""

    num_cells: int  # K
    cell_capacity: int  # C_e
    separate_capacity: int = 0  # C_s
    group_size: int  # N
    oversample: int = 0  # executions per group beyond N; the surplus is cancelled
    batch_groups: int  # B
    extra_groups: int  # phi * B
    mu: int
    rho_min: float
    tau_s: float
    mode: str = "elastic"
    continuous_dispatch: bool = False
    streaming: bool = True
    train_cells: int = 0  # async: cells 0..train_cells-1 train for the whole run
    # The driver reports the buffers' verdict on every closed group (group_accepted / group_rejected): the
    # runtime. False: a group is accepted when its executions close (the simulator; docs/scheduler.md).
    buffer_verdicts: bool = False

    def __post_init__(self) -> None:
        assert self.mode in MODES, self.mode
        assert self.num_cells >= 1 and self.cell_capacity > 0 and self.separate_capacity >= 0
        assert self.group_size >= 1 and self.batch_groups >= 1 and self.mu >= 1 and self.extra_groups >= 0
        assert 0 < self.rho_min <= 1 and self.tau_s >= 0
        if self.mode == "async":
            assert 1 <= self.train_cells <= self.num_cells
        if self.mode == "colocate":
            assert self.extra_groups == 0

    @property
    def executions_per_group(self) -> int:
        return self.group_size + self.oversample

    @property
    def burst_executions(self) -> int:
        """mu N B: executions dispatched after each publication under boundary dispatch."""
        return self.mu * self.batch_groups * self.executions_per_group


@dataclass(frozen=True)
class Dispatch:
    first_group: int
    count: int
    version: int  # the policy version published when these groups were admitted (v_d)
    replaces: int | None = None  # a replacement: the rejected or set-aside group it stands in for (count is 1)


@dataclass(frozen=True)
class Start:
    execution: int
    engine: int


@dataclass(frozen=True)
class Reroute:
    execution: int
    source: int
    destination: int


@dataclass(frozen=True)
class Cancel:
    execution: int


@dataclass(frozen=True)
class BeginTransition:
    cell: int
    to: Role  # Role.TRAINING or Role.ROLLOUT


@dataclass(frozen=True)
class BeginStep:
    step: int  # index of the training step; its trainer version is `step`


@dataclass(frozen=True)
class Publish:
    version: int


@dataclass(frozen=True)
class WakeAt:
    time_s: float  # call Scheduler.tick at this time: the supply timer may elapse then


Action = Dispatch | Start | Reroute | Cancel | BeginTransition | BeginStep | Publish | WakeAt
