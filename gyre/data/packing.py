"""The stream packing buffer: ready groups in, micro-steps out (paper: "Streaming training").

Role: when training runs short of micro-steps the controller calls `pull`, which takes ONE ready group
from the trajectory buffer (oldest policy version first, or the group the scheduler's `claim_group`
chose), computes its group-relative advantages, materializes each admitted trajectory into a token row,
packs the pending rows into micro-steps under `max_tokens_per_microstep` and puts them on the batch's
`MicroStepQueue`. The batch's B groups are selected incrementally; after the B-th group's micro-steps
are enqueued the queue is closed (the stream of the batch is complete). `next_batch` opens the next
stream on a new queue.

Choices, written down (docs/data.md has the reasons):
- Advantages: `group_advantages` over the group's members (N raw executions); an excluded member
  (reward None) gets no rows but counts in `num_executions` = B * N of every micro-step of the batch.
  An execution with no admitted targets (L_i = 0) gets no rows either (it would add zero loss).
- Packing: first-fit decreasing by token count (longest unit first, into the first micro-step with
  room). A unit is one row, or with `keep_executions_together` all rows of one execution. A row is
  never split: its tail would lose the context it was sampled under, so a row longer than the budget
  is a ValueError (raise the budget or bound the path length at admission). With rows of one execution
  in several micro-steps each carries L_i (`num_targets_E`) for `policy_loss`.
- Hold-back: after a pull only micro-steps filled to at least `min_fill` of the budget are emitted; the
  rest of the rows wait for the next group so that micro-steps stay full. The B-th group, `flush`, and
  `top_up` when the queue is short and no group is ready emit everything pending.
- Every check runs before any mutation: on ValueError the group stays in the trajectory buffer.
- Not thread-safe: the controller owns it; training cells only touch the queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gyre.config.checks import require
from gyre.data.microstep import MicroStep, TokenRow, build_microstep
from gyre.data.queue import MicroStepQueue
from gyre.data.trajectory_buffer import RolloutGroup, TrajectoryBuffer
from gyre.rl.advantages import group_advantages

__all__ = ["PackingConfig", "StreamPackingBuffer", "first_fit_decreasing", "materialize_group"]


@dataclass(kw_only=True)
class PackingConfig:
    batch_groups: int
    """[B] groups per training step (>= 1)."""
    group_size: int
    """[N] executions per group (>= 1); every group taken must have this N. num_executions = B * N."""
    max_tokens_per_microstep: int
    """Token budget of one micro-step, rows included whole (>= 1); the longest admitted row must fit."""
    keep_executions_together: bool = False
    """True: all rows of an execution go into one micro-step (needed by a loss without num_targets_E)."""
    min_fill: float = 0.75
    """After a pull, emit only micro-steps holding >= min_fill * budget tokens; in [0, 1] (0: emit all)."""
    normalize_std: bool = False
    """Divide advantages by the group's reward std (+ std_eps); default mean-centred only."""
    std_eps: float = 1e-6
    """eps of the std normalization (> 0)."""

    def __post_init__(self) -> None:
        require(self.batch_groups >= 1, "packing.batch_groups", self.batch_groups, "an integer >= 1 (B)")
        require(self.group_size >= 1, "packing.group_size", self.group_size, "an integer >= 1 (N)")
        require(
            self.max_tokens_per_microstep >= 1,
            "packing.max_tokens_per_microstep",
            self.max_tokens_per_microstep,
            "an integer >= 1",
        )
        require(0 <= self.min_fill <= 1, "packing.min_fill", self.min_fill, "a number in [0, 1]")
        require(self.std_eps > 0, "packing.std_eps", self.std_eps, "a number > 0")

    @property
    def num_executions(self) -> int:
        """B * N: the batch-mean denominator."""
        return self.batch_groups * self.group_size


def materialize_group(group: RolloutGroup, *, normalize_std: bool = False, eps: float = 1e-6) -> list[TokenRow]:
    """Token rows of a ready group: members in reward order, each member's trajectories in admission order.

    ValueError when rewards are missing, or a trajectory's targets do not fit its path (wrong length,
    or a target on a token that is not an engine-sampled token with a recorded log-prob).
    """
    if not group.ready:
        raise ValueError(f"group {group.group_id} has no rewards (not ready): rewards missing")
    assert group.rewards is not None
    members = group.members
    reward_1N = torch.tensor([[math.nan if r is None else r for r in group.rewards.values()]], dtype=torch.float64)
    valid_1N = torch.tensor([[r is not None for r in group.rewards.values()]], dtype=torch.bool)
    advantage_N = group_advantages(reward_1N, valid_1N, normalize_std=normalize_std, eps=eps)[0].tolist()
    rows: list[TokenRow] = []
    for execution, advantage in zip(members, advantage_N, strict=True):
        if group.rewards[execution] is None:
            continue  # excluded: counts in B * N, trains nothing
        trajectories = [t for t in group.admitted.get(execution, ()) if t.num_targets > 0]
        num_targets = sum(t.num_targets for t in trajectories)  # L_i (Eq. 6): targets are disjoint
        tree = group.trees[execution]
        for t in trajectories:
            assert tree is not None
            what = f"admitted trajectory (leaf {t.leaf}) of execution {execution!r}"
            path = tree.path_tokens(t.leaf)
            if t.targets.shape != path.ids.shape:
                raise ValueError(
                    f"{what}: targets has {t.targets.shape[0]} entries but its path has {path.ids.shape[0]} tokens"
                )
            stray = t.targets & ~path.target_mask
            if stray.any():
                where = np.flatnonzero(stray)[:5].tolist()
                raise ValueError(
                    f"{what}: targets at path positions {where} are not engine-sampled tokens with a recorded "
                    "behavior log-prob"
                )
            rows.append(
                TokenRow(
                    group_id=group.group_id,
                    execution=execution,
                    leaf=t.leaf,
                    role=t.role,
                    ids=path.ids.astype(np.int64),
                    targets=t.targets.copy(),
                    behavior_logprobs=np.where(t.targets, path.behavior_logprobs, 0.0),
                    advantage=float(advantage),
                    execution_num_targets=num_targets,
                )
            )
    return rows


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items (by index) into bins of `capacity`: longest first (ties: lower index first), each into
    the first bin with room. Bins are in creation order, items in placement order. ValueError on an
    item longer than the capacity."""
    loads: list[int] = []
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} has {n} tokens, more than the capacity {capacity}")
        for b, load in enumerate(loads):
            if load + n <= capacity:
                loads[b] += n
                bins[b].append(i)
                break
        else:
            loads.append(n)
            bins.append([i])
    return bins


class StreamPackingBuffer:
    """Pulls ready groups one at a time into the current batch and streams its micro-steps."""

    def __init__(self, trajectories: TrajectoryBuffer, config: PackingConfig) -> None:
        if not isinstance(config, PackingConfig):
            raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}")
        self.trajectories = trajectories
        self.config = config
        self._batch = 0
        self._queue: MicroStepQueue[MicroStep] = MicroStepQueue()
        self._groups: list[int] = []  # groups pulled into the current batch, in pull order
        self._pending: list[tuple[TokenRow, ...]] = []  # packing units not yet emitted
        self._emitted = 0  # micro-steps emitted in the current batch

    # -- state --------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self._batch

    @property
    def queue(self) -> MicroStepQueue[MicroStep]:
        """The current batch's queue: training cells claim from it."""
        return self._queue

    @property
    def closed(self) -> bool:
        """The current batch's stream is complete (B groups pulled, every micro-step enqueued)."""
        return self._queue.closed

    @property
    def groups(self) -> tuple[int, ...]:
        """Groups of the current batch, in pull order."""
        return tuple(self._groups)

    @property
    def pending_rows(self) -> int:
        return sum(len(unit) for unit in self._pending)

    # -- pulling ------------------------------------------------------------------------------------
    def pull(self, group_id: int | None = None) -> int | None:
        """Pull one ready group into the batch (the oldest, or `group_id`) and enqueue its micro-steps.

        Returns the group id, or None when no group is ready or the stream is already closed.
        """
        if self.closed:
            if group_id is not None:
                raise ValueError(f"the stream of batch {self._batch} is closed (B groups pulled); call next_batch")
            return None
        chosen = self.trajectories.peek_oldest_ready() if group_id is None else group_id
        if chosen is None:
            return None
        group = self.trajectories.group(chosen)  # ValueError if unknown or already handed out
        if group.group_size != self.config.group_size:
            raise ValueError(
                f"group {chosen} has N={group.group_size} executions, the batch expects "
                f"packing.group_size={self.config.group_size}"
            )
        units = self._units(materialize_group(group, normalize_std=self.config.normalize_std, eps=self.config.std_eps))
        taken = self.trajectories.take(chosen)  # checks done: mutate from here on
        assert taken is group
        self._groups.append(chosen)
        self._pending.extend(units)
        final = len(self._groups) == self.config.batch_groups
        self._emit(everything=final)
        if final:
            self._queue.close()
        return chosen

    def top_up(self, min_pending: int = 1) -> list[int]:
        """Pull groups while fewer than `min_pending` micro-steps wait in the queue and a group is ready.

        If the queue is still short when no group is ready, the held-back rows are flushed: an
        under-filled micro-step is cheaper than an idle cell. Returns the groups pulled.
        """
        pulled: list[int] = []
        while self._queue.pending < min_pending and not self.closed:
            group_id = self.pull()
            if group_id is None:
                self.flush()
                break
            pulled.append(group_id)
        return pulled

    def flush(self) -> int:
        """Emit every pending row now (the trainer is starving and no group is ready); returns micro-steps put."""
        if self.closed:
            return 0
        return self._emit(everything=True)

    def next_batch(self) -> MicroStepQueue[MicroStep]:
        """Open the next batch's stream on a new queue (the current stream must be closed)."""
        if not self.closed:
            raise ValueError(
                f"batch {self._batch} is still open ({len(self._groups)} of {self.config.batch_groups} groups pulled)"
            )
        self._batch += 1
        self._queue = MicroStepQueue()
        self._groups = []
        self._emitted = 0
        return self._queue

    # -- internals ----------------------------------------------------------------------------------
    def _units(self, rows: list[TokenRow]) -> list[tuple[TokenRow, ...]]:
        """Packing units (rows, or an execution's rows), checked against the budget."""
        budget = self.config.max_tokens_per_microstep
        if self.config.keep_executions_together:
            by_execution: dict[str, list[TokenRow]] = {}
            for row in rows:
                by_execution.setdefault(row.execution, []).append(row)
            units = [tuple(unit) for unit in by_execution.values()]
        else:
            units = [(row,) for row in rows]
        for unit in units:
            tokens = sum(row.num_tokens for row in unit)
            if tokens <= budget:
                continue
            if len(unit) == 1:
                raise ValueError(
                    f"the row of execution {unit[0].execution!r} (leaf {unit[0].leaf}) has {tokens} tokens, more "
                    f"than packing.max_tokens_per_microstep={budget}: a row is never split (its tail would lose "
                    "the context it was sampled under); raise the budget above the longest admitted path"
                )
            raise ValueError(
                f"the {len(unit)} rows of execution {unit[0].execution!r} have {tokens} tokens, more than "
                f"packing.max_tokens_per_microstep={budget}: set keep_executions_together=False (the loss takes "
                "num_targets_E) or raise the budget"
            )
        return units

    def _emit(self, *, everything: bool) -> int:
        budget = self.config.max_tokens_per_microstep
        lengths = [sum(row.num_tokens for row in unit) for unit in self._pending]
        keep: list[tuple[TokenRow, ...]] = []
        put = 0
        for bin_units in first_fit_decreasing(lengths, budget):
            if not everything and sum(lengths[i] for i in bin_units) < self.config.min_fill * budget:
                keep.extend(self._pending[i] for i in bin_units)
                continue
            rows = [row for i in bin_units for row in self._pending[i]]
            self._queue.put(build_microstep(self._batch, self._emitted, rows, self.config.num_executions))
            self._emitted += 1
            put += 1
        self._pending = keep
        return put
