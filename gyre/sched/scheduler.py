"""The scheduling policy: counters, boundary dispatch, batches and bursts, and role decisions.

Pure: state and events in, actions out. The caller passes `now` (seconds) with every event; the
scheduler reads no clock and does no IO. One class serves the three modes (`SchedSpec.mode`):

- elastic: cells move to training one at a time, core first then satellites in index order, each
  only when Eq. 2 holds and the supply check has held for tau; the training cells form a growing
  prefix for the whole burst; at burst end satellites return and the core stays only if the supply
  check and Eq. 3 hold.
- colocate: the whole pool of cells switches together once the outstanding work fits the separate
  pool (Eq. 2 for all K cells at once; with no pool: every execution finished).
- async: cells 0..train_cells-1 train for the whole run; the rest roll out.

Counters (executions): d dispatched, p started, f finished: the harness ended (completion, failure,
timeout) or the execution was cancelled (surplus). d - p are queued, p - f running, w = d - f the
waterlevel: harnesses queued or running, not evaluations. An execution's life: queued -> running ->
harness ended (f moves; its evaluation runs) -> closed (the outcome fills or not a slot of its group);
a group's: open -> judged by the buffers -> ready -> claimed (-> set aside by the packer, and replaced), or
rejected and replaced (gyre/sched/groups.py; docs/scheduler.md, "Events the runtime reports").
"""

from __future__ import annotations

import collections

from gyre.sched.groups import GroupBook, GroupState
from gyre.sched.ledger import CapacityLedger
from gyre.sched.staleness import StalenessLog
from gyre.sched.types import (
    Action,
    BeginStep,
    BeginTransition,
    Cancel,
    Dispatch,
    Outcome,
    Publish,
    Role,
    SchedSpec,
    Start,
    WakeAt,
)

_EPS = 1e-9


class Scheduler:
    def __init__(self, spec: SchedSpec) -> None:
        self.spec = spec
        K = spec.num_cells
        roles = [Role.ROLLOUT] * K
        if spec.mode == "async":
            roles[: spec.train_cells] = [Role.TRAINING] * spec.train_cells
        self.ledger = CapacityLedger(K, spec.cell_capacity, spec.separate_capacity, roles)
        self.d = self.p = self.f = 0
        self.groups = GroupBook()
        self._queue: collections.deque[int] = collections.deque()  # queued executions, FIFO
        self._evaluating: set[int] = set()  # harness ended, not yet closed (counted in f)
        self._closed: set[int] = set()
        self.published_version = 0
        self.trainer_version = 0  # steps completed
        self.step_active = False
        self.batch_open = False  # claims allowed (streaming: from step start; else once B are ready)
        self.claimed_in_batch = 0
        self._claimed_in_step: list[int] = []  # groups claimed into the current batch, in claim order
        self.step_in_burst = 0
        self.outcomes: collections.Counter[str] = collections.Counter()  # closed executions by Outcome value
        self.publishing = False
        self._return_after_join: set[int] = set()
        self._left_mid_step: set[int] = set()  # cells that left the step in flight so a replacement can run
        self._supply_since: float | None = None
        self._wake_requested: float | None = None
        self.staleness = StalenessLog()
        self.transitions: list[tuple[float, int, Role]] = []  # (time, cell, target role) as begun

    # -- derived quantities -----------------------------------------------------------------------
    @property
    def roles(self) -> list[Role]:
        return self.ledger.roles

    @property
    def waterlevel(self) -> int:
        """w(t) = d(t) - f(t); non-increasing within a burst under boundary dispatch."""
        return self.d - self.f

    @property
    def queued(self) -> int:
        return self.d - self.p

    @property
    def running(self) -> int:
        return self.p - self.f

    def rollout_capacity(self) -> int:
        return self.ledger.rollout_capacity()

    @property
    def evaluating(self) -> int:
        """Executions whose harness ended and whose evaluation has not closed them yet (in f, not in w)."""
        return len(self._evaluating)

    @property
    def ready_unclaimed(self) -> int:
        return self.groups.ready_unclaimed

    def training_cells(self) -> list[int]:
        """Cells in the training role that may claim micro-steps now."""
        if not self.step_active:
            return []
        return [c for c, role in enumerate(self.roles) if role is Role.TRAINING and c not in self._return_after_join]

    def batch_need(self) -> int:
        """Groups the current (or next) batch still needs."""
        return self.spec.batch_groups - self.claimed_in_batch if self.step_active else self.spec.batch_groups

    def supply(self) -> int:
        """Ready unclaimed groups, capped by what the batch still needs."""
        return min(self.ready_unclaimed, self.batch_need())

    def supply_ok(self) -> bool:
        return self.supply() >= self.spec.rho_min * self.spec.batch_groups - _EPS

    def supply_held(self, now: float) -> bool:
        """The supply check has held continuously for tau."""
        return self._supply_since is not None and now - self._supply_since >= self.spec.tau_s - _EPS

    def group_of(self, execution: int) -> int:
        return execution // self.spec.executions_per_group

    def group_state(self, group: int) -> GroupState:
        """Where a dispatched group stands (gyre/sched/groups.py). `GroupState.JUDGING`: every execution closed
        and, with `buffer_verdicts`, the driver owes the buffers' verdict (`group_accepted` / `group_rejected`)."""
        if not 0 <= group < len(self.groups):
            raise ValueError(f"group {group!r} was never dispatched: groups are 0..{len(self.groups) - 1}")
        return self.groups[group].state

    # -- events -----------------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        """Initial dispatch (phi + mu) N B and the first starts."""
        spec = self.spec
        actions: list[Action] = [self._dispatch(spec.extra_groups + spec.mu * spec.batch_groups)]
        if spec.mode == "async":
            actions += self._begin_step(now)
        return actions + self._settle(now)

    def harness_ended(self, now: float, execution: int) -> list[Action]:
        """The execution's harness process ended: it leaves its engine and f moves; its evaluation follows.

        A harness that ends after the scheduler cancelled it (surplus) is a no-op.
        """
        if execution in self._closed:
            return []  # raced its own Cancel: already closed
        self._end_harness(execution)
        return self._settle(now)

    def execution_closed(self, now: float, execution: int, outcome: Outcome, tokens: float = 0.0) -> list[Action]:
        """The evaluation of an execution whose harness ended gave its outcome and token count.

        Closes a slot of its group (valid outcome or placeholder), cancels the surplus once N slots
        closed, and completes the group when all its executions closed. After a Cancel: a no-op.
        """
        assert outcome is not Outcome.CANCELLED, "cancellations are the scheduler's own decision"
        if execution in self._closed:
            return []  # the evaluation ended after its Cancel (surplus): nothing to do
        assert execution in self._evaluating, f"execution {execution} closed before harness_ended"
        self._evaluating.remove(execution)
        return self._close(execution, outcome, tokens) + self._settle(now)

    def execution_finished(self, now: float, execution: int, outcome: Outcome, tokens: float = 0.0) -> list[Action]:
        """`harness_ended` and `execution_closed` at one instant (the simulator: evaluation takes no time)."""
        assert outcome is not Outcome.CANCELLED, "cancellations are the scheduler's own decision"
        if execution in self._closed:
            return []  # a finish that raced its own cancellation (surplus): already closed, nothing to do
        if execution not in self._evaluating:
            self._end_harness(execution)
        self._evaluating.remove(execution)
        return self._close(execution, outcome, tokens) + self._settle(now)

    def group_accepted(self, now: float, group: int) -> list[Action]:
        """The trajectory buffer and admission took the closed group: it is ready for claims."""
        assert self.spec.buffer_verdicts, "group verdicts are implied when SchedSpec.buffer_verdicts is False"
        self.groups.accept(group)
        return self._settle(now)

    def group_rejected(self, now: float, group: int) -> list[Action]:
        """The buffers refused the closed group: it is never claimed, and one group is dispatched in its place.

        The replacement (`Dispatch(..., count=1, replaces=group)`) carries the version published now, so a
        burst still gets its B groups per step; it is the one dispatch inside a burst under boundary dispatch.
        """
        assert self.spec.buffer_verdicts, "group verdicts are implied when SchedSpec.buffer_verdicts is False"
        self.groups.reject(group)
        return [self._dispatch(1, replaces=group), *self._settle(now)]

    def claimed_group_set_aside(self, now: float, group: int) -> list[Action]:
        """The packer set aside a group `claim_group` handed it in the current batch, before any of its data joined
        the batch (gyre/data/packing.py): the group is not trained and the batch claims another in its place.

        The batch's claim count goes back down and the staleness recorded at the claim is withdrawn (only trained
        groups count). Boundary dispatch: one group is dispatched in its place, `Dispatch(..., count=1,
        replaces=group)`, as for `group_rejected`; continuous dispatch: the claim already dispatched one.
        With no rollout capacity left (C_s = 0, every cell training) and too few ready groups for the rest of
        the burst, the last training cell (colocate: every cell) returns to rollout so the replacement can run, and
        rejoins the step once the rollout side is idle and every group judged (docs/scheduler.md).
        """
        assert self.step_active and group in self._claimed_in_step, f"group {group} is not claimed in this batch"
        self._claimed_in_step.remove(group)
        self.groups.set_claimed_aside(group)
        self.claimed_in_batch -= 1
        g = self.groups[group]
        self.staleness.withdraw(self.trainer_version, self.trainer_version - g.version, g.tokens)
        actions: list[Action] = [] if self.spec.continuous_dispatch else [self._dispatch(1, replaces=group)]
        actions += self._make_room_for_the_batch(now)
        return actions + self._settle(now)

    def transition_finished(self, now: float, cell: int) -> list[Action]:
        role = self.roles[cell]
        assert role in (Role.TO_TRAINING, Role.TO_ROLLOUT), (cell, role)
        actions: list[Action] = []
        if role is Role.TO_ROLLOUT:
            self.roles[cell] = Role.ROLLOUT
        else:
            self.roles[cell] = Role.TRAINING
            if cell in self._return_after_join:  # joined a burst that has ended meanwhile
                self._return_after_join.discard(cell)
                actions.append(self._begin_transition(now, cell, Role.ROLLOUT))
        self._reset_supply_timer(now)
        if self._trainer_ready() and not self.step_active and not self.publishing:
            actions += self._begin_step(now)
        return actions + self._settle(now)

    def claim_group(self, now: float) -> tuple[int | None, list[Action]]:
        """The packing buffer pulls one ready group into the current batch, oldest version first.

        Called when a training cell runs short of micro-steps. Returns the group (None when no step
        is open, the batch is full, no group is ready (non-streaming: fewer than B ready), or the step's
        trainer left it so that a set-aside group's replacement could run) and
        the actions the claim made necessary (continuous dispatch, starts, role decisions).
        """
        if not self.step_active or self.claimed_in_batch >= self.spec.batch_groups:
            return None, []
        if not self._trainer_ready():
            return None, []  # the step's trainer left it for a replacement to run (claimed_group_set_aside)
        if not self.batch_open:
            # Without streaming the trainer waits for the data of the rest of the burst, as a global
            # shuffle across the burst's minibatches needs (mu B groups at a burst's first step).
            if self.ready_unclaimed < self.spec.batch_groups * (self.spec.mu - self.step_in_burst):
                return None, []
            self.batch_open = True
        group = self.groups.claim_oldest()
        if group is None:
            return None, []
        g = self.groups[group]
        self.claimed_in_batch += 1
        self._claimed_in_step.append(group)
        self.staleness.record(self.trainer_version, self.trainer_version - g.version, g.tokens)
        actions: list[Action] = []
        if self.spec.continuous_dispatch:  # keep (phi + mu) B groups outstanding
            actions.append(self._dispatch(1))
        return group, actions + self._settle(now)

    def step_finished(self, now: float) -> list[Action]:
        """All B groups of the step are trained and the core has applied the optimizer update."""
        assert self.step_active and self.claimed_in_batch == self.spec.batch_groups
        self.step_active = False
        self._left_mid_step.clear()  # a cell still out follows the ordinary rules from here
        self.trainer_version += 1
        self.step_in_burst += 1
        if self.step_in_burst < self.spec.mu:
            return self._begin_step(now) + self._settle(now)
        return self._end_burst(now) + self._settle(now)

    def publish_finished(self, now: float) -> list[Action]:
        assert self.publishing
        self.publishing = False
        self.published_version = self.trainer_version
        actions: list[Action] = []
        if not self.spec.continuous_dispatch:
            actions.append(self._dispatch(self.spec.mu * self.spec.batch_groups))  # mu N B executions
        if self._trainer_ready() and not self.step_active:
            actions += self._begin_step(now)
        return actions + self._settle(now)

    def tick(self, now: float) -> list[Action]:
        """Re-evaluate at a time the scheduler asked for with WakeAt."""
        self._wake_requested = None
        return self._settle(now)

    # -- internals: executions --------------------------------------------------------------------
    def _dispatch(self, groups: int, replaces: int | None = None) -> Dispatch:
        first = self.groups.add(groups, self.published_version, replaces)
        per = self.spec.executions_per_group
        self._queue.extend(range(first * per, (first + groups) * per))
        self.d += groups * per
        return Dispatch(first, groups, self.published_version, replaces)

    def _end_harness(self, execution: int) -> None:
        assert execution not in self._evaluating, f"harness of execution {execution} ended twice"
        assert self.ledger.is_running(execution), f"execution {execution} ended without running"
        self.ledger.remove(execution)
        self.f += 1
        self._evaluating.add(execution)

    def _close(self, execution: int, outcome: Outcome, tokens: float) -> list[Action]:
        assert execution not in self._closed, f"execution {execution} closed twice"
        self._closed.add(execution)
        self.outcomes[outcome.value] += 1
        group = self.group_of(execution)
        g = self.groups.record_close(group, outcome, tokens)
        actions: list[Action] = []
        per = self.spec.executions_per_group
        # Only a slot-closing outcome can complete the N; a cancellation never re-enters here, so every
        # Cancel of the surplus is returned by the one `_cancel_surplus` call that closes them all.
        if outcome.closes_group_slot and g.slots >= self.spec.group_size and g.closed < per:
            actions += self._cancel_surplus(group)
        elif g.closed == per:  # the readiness rule: accepted at once unless the buffers judge it
            self.groups.complete(group, accepted=not self.spec.buffer_verdicts)
        return actions

    def _cancel_surplus(self, group: int) -> list[Action]:
        per = self.spec.executions_per_group
        actions: list[Action] = []
        for execution in range(group * per, (group + 1) * per):
            if execution in self._closed:
                continue
            if execution in self._queue:  # never started: count it as started and ended at once
                self._queue.remove(execution)
                self.p += 1
                self.f += 1
            elif execution in self._evaluating:  # harness ended (in f): the runtime cancels its evaluation
                self._evaluating.remove(execution)
                actions.append(Cancel(execution))
            else:
                self.ledger.remove(execution)
                self.f += 1
                actions.append(Cancel(execution))
            self._close(execution, Outcome.CANCELLED, 0.0)
        return actions

    def _start_queued(self) -> list[Action]:
        """Start min{d - p, C_R - (p - f)} queued executions on engines with free slots."""
        actions: list[Action] = []
        while self._queue:
            engine = self.ledger.place(self._queue[0])
            if engine is None:
                break
            actions.append(Start(self._queue.popleft(), engine))
            self.p += 1
        return actions

    # -- internals: steps and bursts --------------------------------------------------------------
    def _trainer_ready(self) -> bool:
        if self.spec.mode == "colocate":
            return all(role is Role.TRAINING for role in self.roles)
        return self.roles[0] is Role.TRAINING

    def _begin_step(self, now: float) -> list[Action]:
        self.step_active = True
        self.batch_open = self.spec.streaming
        self.claimed_in_batch = 0
        self._claimed_in_step = []
        self._reset_supply_timer(now)
        return [BeginStep(self.trainer_version)]

    def _end_burst(self, now: float) -> list[Action]:
        spec = self.spec
        self.step_in_burst = 0
        self.publishing = True
        actions: list[Action] = [Publish(self.trainer_version)]
        if spec.mode == "async":
            return actions
        if spec.mode == "colocate":
            return actions + [self._begin_transition(now, c, Role.ROLLOUT) for c in range(spec.num_cells)]
        for cell in range(1, spec.num_cells):
            if self.roles[cell] is Role.TRAINING:
                actions.append(self._begin_transition(now, cell, Role.ROLLOUT))
            elif self.roles[cell] is Role.TO_TRAINING:
                self._return_after_join.add(cell)
        if not self._core_stays():
            actions.append(self._begin_transition(now, 0, Role.ROLLOUT))
        return actions

    def _core_stays(self) -> bool:
        """End of burst: the core stays in training only if the supply check and Eq. 3 hold."""
        spec = self.spec
        upcoming = 0 if spec.continuous_dispatch else spec.burst_executions
        eq3 = self.waterlevel + upcoming <= spec.separate_capacity + (spec.num_cells - 1) * spec.cell_capacity
        return self.supply_ok() and eq3

    # -- internals: role transitions --------------------------------------------------------------
    def _begin_transition(self, now: float, cell: int, to: Role) -> BeginTransition:
        if to is Role.TRAINING:
            assert self.roles[cell] is Role.ROLLOUT
            self.roles[cell] = Role.TO_TRAINING
        else:
            assert self.roles[cell] is Role.TRAINING
            self.roles[cell] = Role.TO_ROLLOUT
        self.transitions.append((now, cell, to))
        return BeginTransition(cell, to)

    def _to_training(self, now: float, cells: list[int]) -> list[Action]:
        actions: list[Action] = []
        for cell in cells:
            actions.append(self._begin_transition(now, cell, Role.TRAINING))
            actions += self.ledger.evacuate(cell)
        self._reset_supply_timer(now)
        return actions

    def next_candidate(self) -> int | None:
        """Elastic: the next cell to join training (a growing prefix, core first), if it can move now."""
        for cell, role in enumerate(self.roles):
            if role is Role.TRAINING:
                continue
            return cell if role is Role.ROLLOUT else None
        return None

    def eq2_holds(self) -> bool:
        """w(t) <= C_R(t) - C_e (Eq. 2): the remaining rollout capacity covers outstanding work."""
        return self.waterlevel <= self.rollout_capacity() - self.spec.cell_capacity

    def _leaves_no_room_for_a_replacement(self, capacity_after: int) -> bool:
        """A transition that leaves no rollout capacity waits while a group may still be rejected: its
        replacement must have somewhere to run, or the step waiting for it never ends (docs/scheduler.md)."""
        return self.spec.buffer_verdicts and capacity_after == 0 and self.groups.unjudged > 0

    def _make_room_for_the_batch(self, now: float) -> list[Action]:
        """After a set-aside: with no rollout capacity and too few ready groups for the rest of the burst (this
        batch's need, then B per step left), the replacement could never run while the cells wait for it in
        training, so the last training cell (colocate: every cell) leaves the step in flight for rollout; a
        joining cell returns once joined."""
        spec = self.spec
        burst_need = self.batch_need() + spec.batch_groups * (spec.mu - self.step_in_burst - 1)  # this step's, then
        if spec.mode == "async" or self.rollout_capacity() > 0 or self.ready_unclaimed >= burst_need:
            return []
        if self._return_after_join or any(role is Role.TO_ROLLOUT for role in self.roles):
            return []  # a cell is on its way back already
        joining = [c for c, role in enumerate(self.roles) if role is Role.TO_TRAINING]
        self._return_after_join.update(joining)  # (re)joining the step: they return once joined
        self._left_mid_step.update(joining)
        if spec.mode == "colocate":
            leaving = [c for c, role in enumerate(self.roles) if role is Role.TRAINING]
        else:
            leaving = [] if joining else [max(c for c, role in enumerate(self.roles) if role is Role.TRAINING)]
        self._left_mid_step.update(leaving)
        return [self._begin_transition(now, cell, Role.ROLLOUT) for cell in leaving]

    def _role_decisions(self, now: float) -> list[Action]:
        spec = self.spec
        if spec.mode == "async" or self.publishing:
            return []
        if any(role is Role.TO_TRAINING for role in self.roles):
            return []  # transitions are serial
        if spec.mode == "colocate":
            if not all(role is Role.ROLLOUT for role in self.roles):
                return []
            if self.waterlevel > spec.separate_capacity:  # Eq. 2 for the whole pool
                return []
            if self._leaves_no_room_for_a_replacement(spec.separate_capacity):
                return []
            if self._left_mid_step:  # back to the step they left: its replacement ran and was judged
                self._left_mid_step.clear()
                return self._to_training(now, list(range(spec.num_cells)))
            return self._to_training(now, list(range(spec.num_cells))) if self.supply_held(now) else []
        cell = self.next_candidate()
        if cell is None or (cell >= 1 and not self.step_active):
            return []  # satellites join a batch in flight only
        if cell in self._left_mid_step:  # back to the step it left once its replacement ran and was judged
            if not self.eq2_holds() or self._leaves_no_room_for_a_replacement(
                self.rollout_capacity() - spec.cell_capacity
            ):
                return []
            self._left_mid_step.discard(cell)
            return self._to_training(now, [cell])
        if not self.eq2_holds() or not self.supply_held(now):
            return []
        if self._leaves_no_room_for_a_replacement(self.rollout_capacity() - spec.cell_capacity):
            return []
        return self._to_training(now, [cell])

    # -- internals: the supply timer and settling -------------------------------------------------
    def _reset_supply_timer(self, now: float) -> None:
        self._supply_since = now if self.supply_ok() else None

    def _update_supply_timer(self, now: float) -> None:
        if not self.supply_ok():
            self._supply_since = None
        elif self._supply_since is None:
            self._supply_since = now

    def _settle(self, now: float) -> list[Action]:
        """After any event: start what fits, make role decisions, and ask to be woken for tau."""
        actions = self._start_queued()
        self._update_supply_timer(now)
        decided = self._role_decisions(now)
        if decided:
            actions += decided + self._start_queued()
            self._update_supply_timer(now)
        if not decided and self._supply_since is not None and not self.supply_held(now) and self.spec.mode != "async":
            wake = self._supply_since + self.spec.tau_s
            if self._wake_requested is None or self._wake_requested > wake + _EPS or self._wake_requested < now:
                self._wake_requested = wake
                actions.append(WakeAt(wake))
        return actions
