"""Rollout groups as the scheduler sees them, and the one readiness rule (docs/scheduler.md, "Group readiness").

A group is dispatched at the version published then (v_d) and moves through four states:

- OPEN: some of its executions have not closed (queued, running, or harness ended with the evaluation
  still running);
- JUDGING: every execution closed (or was cancelled as surplus) and the trajectory buffer and admission
  (J_max, Eq. 4) have not yet given their verdict; only when the driver reports verdicts
  (`SchedSpec.buffer_verdicts`), otherwise a closed group is accepted at once;
- READY: accepted; it waits in the ready heap until a training cell's claim takes it (CLAIMED);
- REJECTED: the buffers refused it (e.g. a row longer than the micro-step budget); it never becomes ready,
  and the scheduler dispatches a replacement;
- SET_ASIDE: claimed, then refused by the packer before any of its data joined the batch; it is not trained,
  and the batch claims another group in its place (docs/scheduler.md, "A claimed group set aside").

Claims take the oldest version first, ties in the order groups became ready. Pure bookkeeping: no clock,
no actions; the scheduler (gyre/sched/scheduler.py) decides what a state change triggers.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from gyre.sched.types import Outcome


class GroupState(enum.Enum):
    OPEN = "open"
    JUDGING = "judging"
    READY = "ready"
    CLAIMED = "claimed"
    REJECTED = "rejected"
    SET_ASIDE = "set_aside"


@dataclass
class GroupRecord:
    version: int  # v_d
    closed: int = 0  # executions closed (any outcome, cancellations included)
    slots: int = 0  # executions closed with a valid outcome or a placeholder
    tokens: float = 0.0  # tokens of valid executions (weights the token staleness)
    state: GroupState = GroupState.OPEN
    replaces: int | None = None  # the rejected group this one was dispatched for


class GroupBook:
    """Every dispatched group by index, the ready heap, and the count of groups still awaiting a verdict."""

    def __init__(self) -> None:
        self._groups: list[GroupRecord] = []
        self._ready: list[tuple[int, int, int]] = []  # heap of (version, ready order, group)
        self._ready_order = 0
        self.unjudged = 0  # groups OPEN or JUDGING: they may still be accepted or rejected
        self.rejected: list[int] = []  # rejected groups, in the order of their verdicts
        self.set_aside: list[int] = []  # claimed groups the packer set aside, in order

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, group: int) -> GroupRecord:
        return self._groups[group]

    @property
    def ready_unclaimed(self) -> int:
        return len(self._ready)

    def add(self, count: int, version: int, replaces: int | None = None) -> int:
        """Dispatch `count` groups at `version`; returns the index of the first."""
        first = len(self._groups)
        self._groups += [GroupRecord(version=version, replaces=replaces) for _ in range(count)]
        self.unjudged += count
        return first

    def record_close(self, group: int, outcome: Outcome, tokens: float) -> GroupRecord:
        """One execution of an OPEN group closed with `outcome`."""
        g = self._groups[group]
        assert g.state is GroupState.OPEN, (group, g.state)
        g.closed += 1
        if outcome.closes_group_slot:
            g.slots += 1
            if outcome is not Outcome.FAILED:
                g.tokens += tokens
        return g

    def complete(self, group: int, accepted: bool) -> None:
        """Every execution of the group closed: READY now if `accepted`, else JUDGING until the verdict."""
        g = self._groups[group]
        assert g.state is GroupState.OPEN, (group, g.state)
        g.state = GroupState.JUDGING
        if accepted:
            self.accept(group)

    def accept(self, group: int) -> None:
        g = self._groups[group]
        assert g.state is GroupState.JUDGING, f"group {group} accepted while {g.state.value}"
        g.state = GroupState.READY
        self.unjudged -= 1
        heapq.heappush(self._ready, (g.version, self._ready_order, group))
        self._ready_order += 1

    def reject(self, group: int) -> None:
        g = self._groups[group]
        assert g.state is GroupState.JUDGING, f"group {group} rejected while {g.state.value}"
        g.state = GroupState.REJECTED
        self.unjudged -= 1
        self.rejected.append(group)

    def set_claimed_aside(self, group: int) -> None:
        g = self._groups[group]
        assert g.state is GroupState.CLAIMED, f"group {group} set aside while {g.state.value}"
        g.state = GroupState.SET_ASIDE
        self.set_aside.append(group)

    def claim_oldest(self) -> int | None:
        """Take the ready group of the oldest version (None when none is ready)."""
        if not self._ready:
            return None
        _, _, group = heapq.heappop(self._ready)
        self._groups[group].state = GroupState.CLAIMED
        return group
