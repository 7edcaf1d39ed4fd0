"""The trajectory buffer: execution records and rewards per rollout group (paper: "Streaming training").

Role: the controller registers each rollout group when it is dispatched (group id, the policy version
v_d, its executions), attaches each execution's trajectory tree, and marks the group ready with the
members' rewards (from `GroupOutcomes.rewards()`) and the admitted trajectories of each member. The
stream packing buffer takes ready groups from here, oldest policy version first, then in ready order:
the same choice as the scheduler's `claim_group`, so the buffer hands out the data of the group the
scheduler accounted for (or the controller passes the scheduler's choice to `take(group_id)`).

Contract:
- A group is handed out at most once; taking it again, or marking a taken group ready, is a ValueError.
- A group the buffers refused (`mark_ready` raised; the controller reports `group_rejected`, docs/scheduler.md)
  is dropped with `drop_group`: its trees and members are released and it is never handed out. Dropping is not
  idempotent: dropping a group twice, a taken group, a ready group or an unknown one is a ValueError.
- Rewards are a snapshot taken at `mark_ready` (outcomes may change later; the paper reads them once).
  A reward of None marks an excluded member: it keeps its slot (it counts in the batch's B * N) but has
  no reward, advantage 0 and no rows; its admitted trajectories, if any were passed, are dropped.
- Admission is not run here: admitted trajectories are input (`gyre.traj.admission.AdmittedTrajectory`).
  `mark_ready` checks what it can without materializing a path (member, tree, leaf, the length of the
  target mask, and the row length against `max_row_tokens`, the micro-step budget a `StreamPackingBuffer`
  sets when it is built on this buffer); `gyre.data.packing.materialize_group` checks the targets against
  the path's tokens.
- Execution ids are str (tree ids); `mark_ready_from_outcomes` converts the int ids `GroupOutcomes` may
  carry with `str()`.
- Every check runs before any mutation: on ValueError the buffer is unchanged.
- Not thread-safe: the controller owns it (one thread); cells never touch it.
- Holds references to the trees, not copies; the trees of a group are released when it is taken or dropped.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gyre.config.checks import is_int, is_number
from gyre.traj.admission import AdmittedTrajectory
from gyre.traj.outcomes import GroupOutcomes
from gyre.traj.tree import TrajectoryTree

__all__ = ["RolloutGroup", "TrajectoryBuffer"]


@dataclass(eq=False)
class RolloutGroup:
    """One rollout group as the buffer holds it."""

    group_id: int
    version: int  # v_d: the policy version published when the group was dispatched
    group_size: int  # N: the group's slots in the batch denominator B * N
    trees: dict[str, TrajectoryTree | None]  # every dispatched execution (surplus included) -> its tree
    rewards: dict[str, float | None] | None = None  # members -> reward (None: excluded); set when ready
    admitted: dict[str, tuple[AdmittedTrajectory, ...]] = field(default_factory=dict)  # member -> trajectories

    @property
    def ready(self) -> bool:
        return self.rewards is not None

    @property
    def members(self) -> tuple[str, ...]:
        """The executions holding the group's slots (reward order); () before ready."""
        return tuple(self.rewards or ())


class TrajectoryBuffer:
    """Rollout groups by id; ready groups leave oldest policy version first, then in ready order."""

    def __init__(self, max_row_tokens: int | None = None) -> None:
        self._max_row_tokens: int | None = None
        if max_row_tokens is not None:
            self.limit_row_tokens(max_row_tokens)
        self._groups: dict[int, RolloutGroup] = {}
        self._group_of: dict[str, int] = {}  # execution -> group
        self._ready: list[tuple[int, int, int]] = []  # heap of (version, ready order, group id)
        self._ready_count = 0
        self._taken: set[int] = set()
        self._dropped: set[int] = set()

    @property
    def max_row_tokens(self) -> int | None:
        """The longest row (root-to-leaf path of a trajectory with targets) `mark_ready` accepts; None: any."""
        return self._max_row_tokens

    def limit_row_tokens(self, max_row_tokens: int) -> None:
        """Reject, from now on at `mark_ready`, trajectories whose row is longer than `max_row_tokens` (a
        stricter earlier limit stays). Groups already ready are not re-checked; the packer sets a bad one aside."""
        if not is_int(max_row_tokens) or max_row_tokens < 1:
            raise ValueError(f"max_row_tokens must be an int >= 1, got {max_row_tokens!r}")
        if self._max_row_tokens is None or max_row_tokens < self._max_row_tokens:
            self._max_row_tokens = max_row_tokens

    # -- events -------------------------------------------------------------------------------------
    def add_group(self, group_id: int, version: int, executions: Sequence[str], group_size: int | None = None) -> None:
        """Register a group at dispatch: its id, v_d, its execution ids (with any oversampling surplus)
        and N (default: the number of executions)."""
        for name, value in (("group_id", group_id), ("version", version)):
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if group_id in self._groups or group_id in self._taken or group_id in self._dropped:
            raise ValueError(f"group {group_id} is already registered (group ids are never reused)")
        ids = list(executions)
        if not ids or not all(isinstance(e, str) and e for e in ids):
            raise ValueError(f"group {group_id} needs at least one execution id (non-empty strings), got {ids!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"execution ids of group {group_id} must be distinct, got {ids!r}")
        known = [e for e in ids if e in self._group_of]
        if known:
            raise ValueError(f"executions {known!r} already belong to group {self._group_of[known[0]]}")
        size = len(ids) if group_size is None else group_size
        if not is_int(size) or not 1 <= size <= len(ids):
            raise ValueError(f"group_size of group {group_id} must be an int in [1, {len(ids)}], got {group_size!r}")
        self._groups[group_id] = RolloutGroup(group_id, version, size, dict.fromkeys(ids))
        for e in ids:
            self._group_of[e] = group_id

    def attach_tree(self, tree: TrajectoryTree) -> None:
        """Attach the trajectory tree of one registered execution (a reference: it may still grow)."""
        if not isinstance(tree, TrajectoryTree):
            raise TypeError(f"attach_tree takes a TrajectoryTree, got {type(tree).__name__}")
        group = self._open_group(self._group_of_execution(tree.execution), "attach a tree to")
        attached = group.trees[tree.execution]
        if attached is not None and attached is not tree:
            raise ValueError(f"execution {tree.execution!r} already has a different tree attached")
        group.trees[tree.execution] = tree

    def mark_ready(
        self,
        group_id: int,
        rewards: Mapping[str, float | None],
        admitted: Mapping[str, Sequence[AdmittedTrajectory]],
    ) -> None:
        """The group is ready: its members' rewards (None: excluded) and their admitted trajectories."""
        group = self._open_group(group_id, "mark ready")
        if group.ready:
            raise ValueError(f"group {group_id} is already ready")
        if not isinstance(rewards, Mapping) or not rewards:
            raise ValueError(
                f"rewards of group {group_id} are missing: pass member -> reward (None for excluded), "
                "e.g. GroupOutcomes.rewards() once the group is ready"
            )
        if len(rewards) > group.group_size:
            raise ValueError(f"group {group_id} has N={group.group_size} slots, got rewards of {len(rewards)} members")
        for e, r in rewards.items():
            if e not in group.trees:
                raise ValueError(f"reward for execution {e!r}, which is not in group {group_id}: {list(group.trees)!r}")
            if r is not None and (not is_number(r) or not math.isfinite(r)):
                raise ValueError(f"reward of execution {e!r} must be a finite number or None (excluded), got {r!r}")
        checked: dict[str, tuple[AdmittedTrajectory, ...]] = {}
        for e, trajectories in admitted.items():
            if e not in rewards:
                raise ValueError(
                    f"admitted trajectories of execution {e!r}, which has no reward in group {group_id} "
                    f"(members {list(rewards)!r}): rewards missing, or a surplus execution"
                )
            trajectories = tuple(trajectories)
            if rewards[e] is None:
                continue  # excluded: no rows
            checked[e] = self._check_trajectories(e, group.trees[e], trajectories, self._max_row_tokens)
        group.rewards = {e: (None if r is None else float(r)) for e, r in rewards.items()}
        group.admitted = checked
        heapq.heappush(self._ready, (group.version, self._ready_count, group_id))
        self._ready_count += 1

    def mark_ready_from_outcomes(
        self, group_id: int, outcomes: GroupOutcomes, admitted: Mapping[str, Sequence[AdmittedTrajectory]]
    ) -> None:
        """`mark_ready` with `outcomes.rewards()` (a ValueError while the outcomes are not ready).

        Int execution ids of the outcomes are converted with `str()` to the buffer's str ids; members
        that still are not executions of the group are a ValueError listing both sides."""
        group = self._open_group(group_id, "mark ready")
        if outcomes.group_size != group.group_size:
            raise ValueError(f"outcomes have N={outcomes.group_size}, group {group_id} has N={group.group_size}")
        raw = outcomes.rewards()
        rewards = {(str(e) if is_int(e) else e): r for e, r in raw.items()}
        unknown = [e for e in rewards if e not in group.trees]
        if unknown or len(rewards) != len(raw):
            raise ValueError(
                f"the outcomes' members {list(raw)!r} (as buffer ids {list(rewards)!r}) do not match the executions "
                f"of group {group_id}: {list(group.trees)!r}; not in the group: {unknown!r}"
            )
        self.mark_ready(group_id, rewards, admitted)

    # -- handing out --------------------------------------------------------------------------------
    def ready_groups(self) -> list[int]:
        """Ready, not yet taken group ids in the order they will be handed out."""
        return [g for _, _, g in sorted(self._ready)]

    def peek_oldest_ready(self) -> int | None:
        """The group `take_oldest_ready` would hand out, without taking it."""
        return self._ready[0][2] if self._ready else None

    def take_oldest_ready(self) -> RolloutGroup | None:
        """Hand out the ready group with the oldest policy version (ties: ready order); None if none."""
        if not self._ready:
            return None
        return self.take(self._ready[0][2])

    def take(self, group_id: int) -> RolloutGroup:
        """Hand out one ready group by id (e.g. the scheduler's `claim_group` choice). Once only."""
        if group_id in self._taken:
            raise ValueError(f"group {group_id} was already handed out: a group is trained once")
        group = self.group(group_id)
        if not group.ready:
            raise ValueError(f"group {group_id} is not ready: rewards missing (mark_ready first)")
        self._ready = [entry for entry in self._ready if entry[2] != group_id]
        heapq.heapify(self._ready)
        self._forget(group)
        self._taken.add(group_id)
        return group

    def drop_group(self, group_id: int) -> RolloutGroup:
        """Drop a group that was never marked ready (the buffers refused it): release its trees and members.

        Returns the dropped group (for logging). Its id stays used. A ValueError, and nothing changes, when the
        group is unknown, was already dropped or handed out, or is ready (the scheduler may claim a ready group:
        a ready group leaves through `take`, or the packer sets it aside)."""
        if group_id in self._dropped:
            raise ValueError(f"group {group_id} was already dropped")
        group = self._open_group(group_id, "drop")
        if group.ready:
            raise ValueError(
                f"group {group_id} is ready and may be claimed: only a group that was not marked ready is dropped"
            )
        self._forget(group)
        self._dropped.add(group_id)
        return group

    # -- reading ------------------------------------------------------------------------------------
    def group(self, group_id: int) -> RolloutGroup:
        """A group still held (not taken)."""
        try:
            return self._groups[group_id]
        except KeyError:
            gone = " (already handed out)" if group_id in self._taken else ""
            gone = " (dropped)" if group_id in self._dropped else gone
            raise ValueError(f"unknown group {group_id!r}{gone}") from None

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    def __repr__(self) -> str:
        return (
            f"TrajectoryBuffer(groups={len(self._groups)}, ready={len(self._ready)}, taken={len(self._taken)}, "
            f"dropped={len(self._dropped)})"
        )

    @property
    def num_dropped(self) -> int:
        return len(self._dropped)

    # -- internals ----------------------------------------------------------------------------------
    def _forget(self, group: RolloutGroup) -> None:
        """Release a group the buffer no longer holds (taken or dropped): its entry and its executions."""
        del self._groups[group.group_id]
        for e in group.trees:
            del self._group_of[e]

    def _group_of_execution(self, execution: str) -> int:
        try:
            return self._group_of[execution]
        except KeyError:
            raise ValueError(f"unknown execution {execution!r}: register its group with add_group first") from None

    def _open_group(self, group_id: int, action: str) -> RolloutGroup:
        if group_id in self._taken:
            raise ValueError(f"cannot {action} group {group_id}: it was already handed out")
        return self.group(group_id)

    @staticmethod
    def _check_trajectories(
        execution: str,
        tree: TrajectoryTree | None,
        trajectories: tuple[AdmittedTrajectory, ...],
        max_row_tokens: int | None,
    ) -> tuple[AdmittedTrajectory, ...]:
        if trajectories and tree is None:
            raise ValueError(f"execution {execution!r} has admitted trajectories but no tree attached")
        leaves: set[int] = set()
        for k, t in enumerate(trajectories):
            what = f"admitted trajectory {k} of execution {execution!r}"
            if not isinstance(t, AdmittedTrajectory):
                raise TypeError(f"{what} is a {type(t).__name__}; expected an AdmittedTrajectory")
            if t.execution != execution:
                raise ValueError(f"{what} belongs to execution {t.execution!r}")
            assert tree is not None
            if not is_int(t.leaf) or not 0 < t.leaf < len(tree.nodes):
                raise ValueError(f"{what}: leaf {t.leaf!r} is not a node of its tree (1..{len(tree.nodes) - 1})")
            if t.leaf in leaves:
                raise ValueError(f"{what}: leaf {t.leaf} is admitted twice")
            leaves.add(t.leaf)
            targets = t.targets
            path_length = tree.nodes[t.leaf].prefix_tokens
            if not isinstance(targets, np.ndarray) or targets.dtype != np.bool_ or targets.ndim != 1:
                raise ValueError(f"{what}: targets must be a 1-D bool numpy array, got {targets!r:.80}")
            if targets.shape[0] != path_length:
                raise ValueError(
                    f"{what}: targets has {targets.shape[0]} entries but the path to leaf {t.leaf} has "
                    f"{path_length} tokens (one entry per path token)"
                )
            if max_row_tokens is not None and path_length > max_row_tokens and bool(targets.any()):
                raise ValueError(
                    f"{what}: its row (the path to leaf {t.leaf}) has {path_length} tokens, more than the "
                    f"micro-step budget max_row_tokens={max_row_tokens} (packing.max_tokens_per_microstep): a row "
                    "is never split; raise the budget or bound the path length at admission"
                )
        return trajectories
