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
  room). With `keep_executions_together` (default) a unit is all rows of one execution, so s_i and m_i
  (Eq. 5) are computed within one micro-step; an execution larger than the budget is split: its rows
  are packed first into micro-steps of its own (other whole executions may fill their room), emitted in
  the same pull, consecutively, and flagged in `split_E`. With `keep_executions_together=False` a unit is
  one row: rows pack freely, an execution may land in several micro-steps of the same pull (not
  necessarily consecutive), flagged in `split_E`. A row is never split: its tail would lose the context
  it was sampled under, so a row longer than the budget is rejected (at `mark_ready` once the trajectory
  buffer knows the budget, else the group is set aside at `pull`).
- Hold-back: after a pull only micro-steps filled to at least `min_fill` of the budget are emitted; the
  rest of the rows wait for the next group so that micro-steps stay full. Part of an execution is never
  held back: a micro-step holding rows of an execution that is (partly) emitted is emitted too, and a
  split execution's micro-steps always are. The B-th group, `flush`, and `top_up` when the queue is short
  and no group is ready emit everything pending.
- A ready group that fails a check (N, a row over the budget, targets that do not fit the path, routing of
  other (layers, top_k) than the rows packed before) is set aside (`rejected_groups()`, logged) and the next
  ready group is pulled: one bad group never blocks the stream. Checks run before the group joins the batch:
  a set-aside group adds nothing to it.
- Not thread-safe: the controller owns it; training cells only touch the queue.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import torch

from gyre.config.packing import PackingConfig
from gyre.data.microstep import MicroStep, TokenRow, build_microstep
from gyre.data.queue import MicroStepQueue
from gyre.data.trajectory_buffer import RolloutGroup, TrajectoryBuffer
from gyre.rl.advantages import group_advantages

__all__ = ["StreamPackingBuffer", "first_fit_decreasing", "materialize_group"]

log = logging.getLogger(__name__)


def materialize_group(
    group: RolloutGroup, *, normalize_std: bool = False, eps: float = 1e-6, slot_offset: int = 0
) -> list[TokenRow]:
    """Token rows of a ready group: members in reward order, each member's trajectories in admission order.

    A row's `batch_execution` is `slot_offset` + its member's index (the packer passes the group's
    position in the batch times N). A row's `routed_experts_TLK` is its tree's `path_routing(leaf)`
    (None when no call of the tree had routing).

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
    for member, (execution, advantage) in enumerate(zip(members, advantage_N, strict=True)):
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
                    batch_execution=slot_offset + member,
                    routed_experts_TLK=tree.path_routing(t.leaf),  # None when the tree has no routing
                )
            )
    return rows


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items (by index) into bins of `capacity`: longest first (ties: lower index first), each into
    the first bin with room. Bins are in creation order, items in placement order. ValueError on an
    item longer than the capacity."""
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"item {i} has {n} tokens, more than the capacity {capacity}")
    loads: list[int] = []
    bins: list[list[int]] = []
    for i, b in place_first_fit_decreasing(lengths, capacity, loads):
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
    return bins


def place_first_fit_decreasing(
    lengths: Sequence[int], capacity: int, loads: list[int], first_bin: int = 0
) -> list[tuple[int, int]]:
    """The placement under `first_fit_decreasing`, onto existing bins: items longest first (ties: lower index
    first), each into the first bin from `first_bin` on whose load leaves room, else a new bin appended to
    `loads` (which is updated). Returns (item, bin) in placement order. An item over `capacity` gets a bin of
    its own."""
    placed = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        b = next((b for b in range(first_bin, len(loads)) if loads[b] + n <= capacity), len(loads))
        if b == len(loads):
            loads.append(0)
        loads[b] += n
        placed.append((i, b))
    return placed


class StreamPackingBuffer:
    """Pulls ready groups one at a time into the current batch and streams its micro-steps."""

    def __init__(self, trajectories: TrajectoryBuffer, config: PackingConfig) -> None:
        if not isinstance(config, PackingConfig):
            raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}")
        self.trajectories = trajectories
        self.config = config
        # From now on mark_ready rejects a trajectory whose row would not fit a micro-step.
        trajectories.limit_row_tokens(config.max_tokens_per_microstep)
        self._batch = 0
        self._queue: MicroStepQueue[MicroStep] = MicroStepQueue()
        self._groups: list[int] = []  # groups pulled into the current batch, in pull order
        self._pending: list[tuple[TokenRow, ...]] = []  # packing units not yet emitted (whole executions)
        self._emitted = 0  # micro-steps emitted in the current batch
        self._rejected: list[tuple[int, str]] = []  # groups set aside by pull, with the reason
        self._routing_layers_topk: tuple[int, ...] | None = None  # (layers, top_k) of the first routed row packed

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

    def rejected_groups(self) -> list[tuple[int, str]]:
        """(group id, reason) of every ready group `pull` set aside instead of packing, in order."""
        return list(self._rejected)

    # -- pulling ------------------------------------------------------------------------------------
    def pull(self, group_id: int | None = None) -> int | None:
        """Pull one ready group into the batch (the oldest, or `group_id`) and enqueue its micro-steps.

        Returns the group id, or None when no group is ready or the stream is already closed. A ready
        group that fails a check is taken out of the trajectory buffer and set aside
        (`rejected_groups()`, logged); without `group_id` the next ready group is pulled instead, with
        `group_id` the ValueError is raised (after setting the group aside).
        """
        if self.closed:
            if group_id is not None:
                raise ValueError(f"the stream of batch {self._batch} is closed (B groups pulled); call next_batch")
            return None
        while True:
            chosen = self.trajectories.peek_oldest_ready() if group_id is None else group_id
            if chosen is None:
                return None
            group = self.trajectories.group(chosen)  # ValueError if unknown or already handed out
            if not group.ready:
                raise ValueError(f"group {chosen} is not ready: rewards missing (mark_ready first)")
            try:
                whole, split = self._units(group)
            except ValueError as error:
                self._set_aside(chosen, str(error))
                if group_id is not None:
                    raise ValueError(f"group {chosen} was set aside (see rejected_groups()): {error}") from error
                continue
            break
        taken = self.trajectories.take(chosen)  # checks done: mutate from here on
        assert taken is group
        self._groups.append(chosen)
        self._pending.extend(whole)
        final = len(self._groups) == self.config.batch_groups
        self._emit(split, everything=final)
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
        return self._emit([], everything=True)

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

    def resume_at(self, batch: int) -> None:
        """Number the current batch `batch` (a run resumed from a checkpoint taken after batch `batch - 1`); nothing
        may have been pulled yet."""
        if self._groups or self._pending or self._emitted:
            raise ValueError(f"batch {self._batch} has groups pulled already: a packer resumes before any pull")
        self._batch = batch

    # -- internals ----------------------------------------------------------------------------------
    def _set_aside(self, group_id: int, reason: str) -> None:
        self.trajectories.take(group_id)
        self._rejected.append((group_id, reason))
        log.warning("packing: group %d set aside, not trained: %s", group_id, reason)

    def _units(self, group: RolloutGroup) -> tuple[list[tuple[TokenRow, ...]], list[list[tuple[TokenRow, ...]]]]:
        """Check a ready group and cut its rows into packing units: (whole units, split executions' row units).

        With `keep_executions_together` a whole unit is all rows of an execution that fits the budget, and
        each larger execution is a list of one-row units; otherwise every row is a whole unit."""
        config = self.config
        if group.group_size != config.group_size:
            raise ValueError(
                f"group {group.group_id} has N={group.group_size} executions, the batch expects "
                f"packing.group_size={config.group_size}"
            )
        rows = materialize_group(
            group,
            normalize_std=config.normalize_std,
            eps=config.std_eps,
            slot_offset=len(self._groups) * config.group_size,
        )
        budget = config.max_tokens_per_microstep
        for row in rows:
            if row.num_tokens > budget:
                raise ValueError(
                    f"the row of execution {row.execution!r} (leaf {row.leaf}) has {row.num_tokens} tokens, more "
                    f"than packing.max_tokens_per_microstep={budget}: a row is never split (its tail would lose "
                    "the context it was sampled under); raise the budget above the longest admitted path"
                )
        self._check_routing(rows)
        if not config.keep_executions_together:
            return [(row,) for row in rows], []
        by_execution: dict[str, list[TokenRow]] = {}
        for row in rows:
            by_execution.setdefault(row.execution, []).append(row)
        whole: list[tuple[TokenRow, ...]] = []
        split: list[list[tuple[TokenRow, ...]]] = []
        for execution_rows in by_execution.values():
            if sum(row.num_tokens for row in execution_rows) <= budget:
                whole.append(tuple(execution_rows))
            else:
                split.append([(row,) for row in execution_rows])
        return whole, split

    def _check_routing(self, rows: list[TokenRow]) -> None:
        """Every routed row has the (layers, top_k) of the rows packed before (one model per run): else ValueError,
        the group is set aside, rather than a micro-step that cannot be built later."""
        expected = self._routing_layers_topk
        for row in rows:
            if row.routed_experts_TLK is None:
                continue
            layers_topk = tuple(row.routed_experts_TLK.shape[1:])
            if expected is None:
                expected = layers_topk
            elif layers_topk != expected:
                raise ValueError(
                    f"the row of execution {row.execution!r} (leaf {row.leaf}) has routing of {layers_topk[0]} layers "
                    f"x top-{layers_topk[1]}; other rows have {expected[0]} layers x top-{expected[1]} (one model "
                    "per run)"
                )
        self._routing_layers_topk = expected  # the last check of `_units`: the group is packed

    def _emit(self, split: list[list[tuple[TokenRow, ...]]], *, everything: bool) -> int:
        """Pack and enqueue: each split execution's rows first into micro-steps of its own, then the pending
        units first-fit decreasing into any micro-step with room. Emit split executions' micro-steps, those
        filled to min_fill (all if `everything`) and, transitively, any sharing an execution with an emitted
        one; the rest stays pending."""
        budget = self.config.max_tokens_per_microstep
        bins: list[list[tuple[TokenRow, ...]]] = []
        loads: list[int] = []

        def place(units: list[tuple[TokenRow, ...]], first_bin: int) -> None:
            lengths = [sum(row.num_tokens for row in unit) for unit in units]
            for i, b in place_first_fit_decreasing(lengths, budget, loads, first_bin):
                if b == len(bins):
                    bins.append([])
                bins[b].append(units[i])

        for execution_units in split:  # micro-steps of its own: consecutive, never shared with another split
            place(execution_units, len(bins))
        num_split_bins = len(bins)
        place(self._pending, 0)

        fill = self.config.min_fill * budget
        emit = [everything or b < num_split_bins or load >= fill for b, load in enumerate(loads)]
        bins_of: dict[tuple[int, str], set[int]] = {}  # (group, execution) -> its micro-steps
        for b, units in enumerate(bins):
            for unit in units:
                for row in unit:
                    bins_of.setdefault((row.group_id, row.execution), set()).add(b)
        changed = True
        while changed:  # never hold back part of an execution
            changed = False
            for members in bins_of.values():
                if any(emit[b] for b in members) and not all(emit[b] for b in members):
                    for b in members:
                        emit[b] = True
                    changed = True
        split_executions = {e for (_, e), members in bins_of.items() if len(members) > 1}
        self._pending = [unit for b, units in enumerate(bins) if not emit[b] for unit in units]
        put = 0
        for b, units in enumerate(bins):
            if not emit[b]:
                continue
            rows = [row for unit in units for row in unit]
            self._queue.put(
                build_microstep(self._batch, self._emitted, rows, self.config.num_executions, split_executions)
            )
            self._emitted += 1
            put += 1
        return put
