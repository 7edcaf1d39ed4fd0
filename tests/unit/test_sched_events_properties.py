"""Property tests of the runtime's events: harness end, evaluation close, the buffers' verdict, and their races.

A random driver plays the split events (docs/scheduler.md, "Events the runtime reports") with and without
`buffer_verdicts`: it ends a running harness (`harness_ended`, or now and then `execution_finished`), closes
an evaluation with a random outcome, accepts or rejects a judged group, re-delivers an end or a close for
an execution the scheduler cancelled (a race), and plays transitions, claims, steps, publications and ticks
as test_sched_properties.py does. It keeps its own account of every execution (queued, running, evaluating,
closed) and group (open, judging, ready, claimed, rejected), and after EVERY event checks: d >= p >= f with
f = evaluations in flight + closed executions, so w = d - f counts queued and running harnesses only; no
execution closes twice and only the surplus of a group with N slots is cancelled; a group is ready exactly
when accepted (or, without verdicts, when closed); a replacement is dispatched exactly for each rejection;
raced events are no-ops; Eq. 2 at each transition, and no transition leaves the rollout side empty while
a group can still be rejected. At the end a cooperative driver that also rejects groups must complete one
more burst: a rejected group never blocks a step.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.sched import (
    POOL,
    BeginStep,
    BeginTransition,
    Cancel,
    Dispatch,
    Outcome,
    Publish,
    Reroute,
    Role,
    SchedSpec,
    Scheduler,
    Start,
    WakeAt,
)

T, R, TO_T, TO_R = Role.TRAINING, Role.ROLLOUT, Role.TO_TRAINING, Role.TO_ROLLOUT
FINISH_OUTCOMES = (Outcome.COMPLETED, Outcome.HARNESS_TIMEOUT, Outcome.OVERALL_TIMEOUT, Outcome.FAILED)
RANDOM_MOVES = 160
DRAIN_EVENTS = 6000
DRAIN_REJECTIONS = 2  # the cooperative drain still rejects this many groups


@st.composite
def sched_specs(draw, mode: str, continuous: bool, verdicts: bool) -> SchedSpec:
    num_cells = draw(st.integers(1, 4))
    group_size, oversample = draw(st.integers(1, 3)), draw(st.integers(0, 2))
    train_cells = draw(st.integers(1, num_cells)) if mode == "async" else 0
    cell_capacity = draw(st.integers(1, 6))
    separate_capacity = draw(st.one_of(st.just(0), st.integers(1, 8)))
    rollout = separate_capacity + (num_cells - train_cells) * cell_capacity
    if rollout < group_size + oversample:  # the config checks: the rollout side runs one whole group
        separate_capacity += group_size + oversample - rollout
    batch_groups = draw(st.integers(1, 3))
    return SchedSpec(
        num_cells=num_cells,
        cell_capacity=cell_capacity,
        separate_capacity=separate_capacity,
        group_size=group_size,
        oversample=oversample,
        batch_groups=batch_groups,
        extra_groups=0 if mode == "colocate" else draw(st.integers(0, 2 * batch_groups)),
        mu=draw(st.integers(1, 3)),
        rho_min=draw(st.sampled_from([0.25, 0.5, 1.0])),
        tau_s=draw(st.sampled_from([0.0, 0.5, 1.25])),
        mode=mode,
        continuous_dispatch=continuous,
        streaming=draw(st.booleans()),
        train_cells=train_cells,
        buffer_verdicts=verdicts,
    )


class EventDriver:
    """Carries out actions, keeps an independent account of executions and groups, checks after each event."""

    def __init__(self, spec: SchedSpec) -> None:
        self.spec, self.sched, self.per = spec, Scheduler(spec), spec.executions_per_group
        self.now = 0.0
        self.roles = list(self.sched.roles)
        self.transitioning: set[int] = set()
        self.step_active = self.publishing = False
        self.trainer_version = self.published_version = self.claimed_in_batch = 0
        self.wakes: list[float] = []
        self.state: dict[int, str] = {}  # execution -> queued | running | evaluating | closed
        self.where: dict[int, int] = {}  # running execution -> engine
        self.closes: collections.Counter[int] = collections.Counter()
        self.cancelled: set[int] = set()
        self.version: list[int] = []
        self.group_state: list[str] = []  # open | judging | ready | claimed | rejected
        self.slots: collections.Counter[int] = collections.Counter()
        self.last_rejected: int | None = None
        self.rejections = 0

    # -- the account --------------------------------------------------------------------------------
    def in_state(self, state: str) -> list[int]:
        return sorted(e for e, s in self.state.items() if s == state)

    def groups_in(self, state: str) -> list[int]:
        return [g for g, s in enumerate(self.group_state) if s == state]

    def close(self, execution: int, cancelled: bool) -> None:
        assert self.state[execution] != "closed" and self.closes[execution] == 0, f"{execution} closed twice"
        self.state[execution] = "closed"
        self.closes[execution] += 1
        self.where.pop(execution, None)
        if cancelled:
            self.cancelled.add(execution)
        group = execution // self.per
        members = range(group * self.per, (group + 1) * self.per)
        if all(self.state[e] == "closed" for e in members):
            assert self.group_state[group] == "open"
            self.group_state[group] = "judging" if self.spec.buffer_verdicts else "ready"

    def record_slot(self, execution: int, outcome: Outcome) -> None:
        group = execution // self.per
        if outcome.closes_group_slot:
            self.slots[group] += 1
        self.close(execution, cancelled=False)
        if self.slots[group] >= self.spec.group_size:  # queued surplus is closed without a Cancel
            for e in range(group * self.per, (group + 1) * self.per):
                if self.state[e] == "queued":
                    self.close(e, cancelled=True)

    def rollout_capacity(self) -> int:
        return self.spec.separate_capacity + self.spec.cell_capacity * self.roles.count(R)

    def supply_ok(self) -> bool:
        need = self.spec.batch_groups - self.claimed_in_batch if self.step_active else self.spec.batch_groups
        return min(len(self.groups_in("ready")), need) >= self.spec.rho_min * self.spec.batch_groups - 1e-9

    # -- events -------------------------------------------------------------------------------------
    def end_harness(self, execution: int, composed: bool, outcome: Outcome) -> None:
        if composed:
            self.state[execution] = "evaluating"
            self.record_slot(execution, outcome)
            self.apply("execution_finished", self.sched.execution_finished(self.now, execution, outcome, 1.0))
        else:
            self.state[execution] = "evaluating"
            del self.where[execution]
            self.apply("harness_ended", self.sched.harness_ended(self.now, execution))

    def close_evaluation(self, execution: int, outcome: Outcome) -> None:
        self.record_slot(execution, outcome)
        self.apply("execution_closed", self.sched.execution_closed(self.now, execution, outcome, 1.0))

    def race(self, execution: int, kind: str) -> None:
        before = (self.sched.d, self.sched.p, self.sched.f, self.sched.evaluating, sum(self.sched.outcomes.values()))
        if kind == "end":
            actions = self.sched.harness_ended(self.now, execution)
        elif kind == "close":
            actions = self.sched.execution_closed(self.now, execution, Outcome.COMPLETED, 1.0)
        else:
            actions = self.sched.execution_finished(self.now, execution, Outcome.FAILED)
        assert actions == [], (kind, execution, actions)
        after = (self.sched.d, self.sched.p, self.sched.f, self.sched.evaluating, sum(self.sched.outcomes.values()))
        assert after == before
        self.check_state("race")

    def verdict(self, group: int, accept: bool) -> None:
        if accept:
            self.group_state[group] = "ready"
            self.apply("group_accepted", self.sched.group_accepted(self.now, group))
        else:
            self.group_state[group] = "rejected"
            self.last_rejected = group
            self.rejections += 1
            self.apply("group_rejected", self.sched.group_rejected(self.now, group))

    def finish_transition(self, cell: int) -> None:
        self.transitioning.discard(cell)
        self.roles[cell] = T if self.roles[cell] is TO_T else R
        self.apply("transition_finished", self.sched.transition_finished(self.now, cell))

    def claim(self) -> int | None:
        ready = self.groups_in("ready")
        group, actions = self.sched.claim_group(self.now)
        if group is not None:
            assert group in ready, "only an accepted group is claimed"
            assert self.version[group] == min(self.version[g] for g in ready)
            self.group_state[group] = "claimed"
            self.claimed_in_batch += 1
        self.apply("claim_group", actions)
        return group

    def finish_step(self) -> None:
        self.step_active, self.claimed_in_batch = False, 0
        self.trainer_version += 1
        self.apply("step_finished", self.sched.step_finished(self.now))

    def finish_publish(self) -> None:
        self.publishing, self.published_version = False, self.trainer_version
        self.apply("publish_finished", self.sched.publish_finished(self.now))

    def tick(self) -> None:
        self.wakes = [w for w in self.wakes if w > self.now]
        self.apply("tick", self.sched.tick(self.now))

    # -- actions ------------------------------------------------------------------------------------
    def apply(self, event: str, actions: list) -> None:
        spec = self.spec
        for action in actions:
            if isinstance(action, Dispatch):
                assert action.first_group == len(self.version) and action.version == self.published_version
                if action.replaces is not None:
                    assert event in ("group_rejected", "claimed_group_set_aside"), (event, action)
                    assert action.replaces == self.last_rejected and action.count == 1
                    self.last_rejected = None
                elif spec.continuous_dispatch:
                    assert event == "start" or (event == "claim_group" and action.count == 1), (event, action)
                else:
                    assert event in ("start", "publish_finished"), (event, action)
                for group in range(action.first_group, action.first_group + action.count):
                    self.version.append(action.version)
                    self.group_state.append("open")
                    self.state.update(dict.fromkeys(range(group * self.per, (group + 1) * self.per), "queued"))
            elif isinstance(action, Start):
                assert self.state[action.execution] == "queued"
                assert action.engine == POOL or self.roles[action.engine] is R
                self.state[action.execution] = "running"
                self.where[action.execution] = action.engine
            elif isinstance(action, Reroute):
                assert self.where[action.execution] == action.source and self.roles[action.source] is TO_T
                self.where[action.execution] = action.destination
            elif isinstance(action, Cancel):
                assert self.state[action.execution] in ("running", "evaluating"), (action, self.state[action.execution])
                assert self.slots[action.execution // self.per] >= spec.group_size, "only the surplus is cancelled"
                self.close(action.execution, cancelled=True)
            elif isinstance(action, BeginTransition):
                if action.to is T:
                    self.check_to_training(action.cell)
                self.roles[action.cell] = TO_T if action.to is T else TO_R
                self.transitioning.add(action.cell)
            elif isinstance(action, BeginStep):
                assert not self.step_active and action.step == self.trainer_version
                self.step_active, self.claimed_in_batch = True, 0
            elif isinstance(action, Publish):
                assert event == "step_finished" and action.version == self.trainer_version
                self.publishing = True
            elif isinstance(action, WakeAt):
                self.wakes.append(action.time_s)
            else:
                raise AssertionError(f"unknown action {action!r}")
        assert self.last_rejected is None, "every rejection dispatches its replacement at once"
        self.check_state(event)

    def check_to_training(self, cell: int) -> None:
        spec = self.spec
        w = len(self.in_state("queued")) + len(self.in_state("running"))
        assert self.supply_ok()
        may_be_rejected = spec.buffer_verdicts and (self.groups_in("open") or self.groups_in("judging"))
        if spec.mode == "colocate":
            assert w <= spec.separate_capacity  # Eq. 2 for the whole pool
            assert not (may_be_rejected and spec.separate_capacity == 0), "no rollout side left for a replacement"
            return
        assert w <= self.rollout_capacity() - spec.cell_capacity, (w, self.rollout_capacity())  # Eq. 2
        assert not (may_be_rejected and self.rollout_capacity() == spec.cell_capacity), "last rollout slots"

    def check_state(self, event: str) -> None:
        spec, sched = self.spec, self.sched
        queued, running = len(self.in_state("queued")), len(self.in_state("running"))
        evaluating, closed = len(self.in_state("evaluating")), len(self.in_state("closed"))
        d = len(self.state)
        p, f = d - queued, evaluating + closed
        assert (sched.d, sched.p, sched.f) == (d, p, f), ((sched.d, sched.p, sched.f), (d, p, f), event)
        assert d >= p >= f and sched.waterlevel == queued + running and sched.evaluating == evaluating
        assert sched.ledger.running == running == len(self.where) <= self.rollout_capacity()
        loads = collections.Counter(self.where.values())
        for engine in [POOL, *range(spec.num_cells)]:
            assert loads[engine] == sched.ledger.load(engine)
        assert sum(sched.outcomes.values()) == closed and sched.outcomes["cancelled"] == len(self.cancelled)
        assert sched.ready_unclaimed == len(self.groups_in("ready")), "ready exactly when accepted"
        for group, state in enumerate(self.group_state):
            assert sched.groups[group].state.value == state, (group, state, event)
        assert sorted(sched.groups.rejected) == self.groups_in("rejected")
        if spec.continuous_dispatch:  # (phi + mu) B groups outstanding: claims and rejections are replaced
            consumed = len(self.groups_in("claimed")) + len(self.groups_in("set_aside"))  # a claim dispatches one
            outstanding = len(self.version) - consumed - len(self.groups_in("rejected"))
            assert outstanding == spec.extra_groups + spec.mu * spec.batch_groups
        assert sched.roles == self.roles

    # -- moves --------------------------------------------------------------------------------------
    def extra_move(self, move: str, data: st.DataObject) -> bool:
        """A subclass's own move (True when `move` was one of its own and has been played)."""
        return False

    def moves(self) -> list[str]:
        moves = []
        if self.where:
            moves.append("end")
        if self.in_state("evaluating"):
            moves.append("close")
        if self.cancelled:
            moves.append("race")
        if self.groups_in("judging"):
            moves.append("verdict")
        if self.transitioning:
            moves.append("transition")
        if self.step_active and self.claimed_in_batch < self.spec.batch_groups:
            moves.append("claim")
        if self.step_active and self.claimed_in_batch == self.spec.batch_groups:
            moves.append("step")
        if self.publishing:
            moves.append("publish")
        return [*moves, "tick"]

    def drain_one_burst(self) -> None:
        """A cooperative driver that still rejects a few groups completes the next burst."""
        target, rejections = self.trainer_version + self.spec.mu + 1, 0
        for _ in range(DRAIN_EVENTS):
            if self.trainer_version >= target:
                return
            judging = self.groups_in("judging")
            if self.publishing:
                self.finish_publish()
            elif self.step_active and self.claimed_in_batch == self.spec.batch_groups:
                self.finish_step()
            elif self.transitioning:
                self.finish_transition(min(self.transitioning))
            elif judging:
                reject = rejections < DRAIN_REJECTIONS
                self.verdict(judging[0], accept=not reject)
                rejections += reject
            elif self.step_active and self.groups_in("ready") and self.claim() is not None:
                continue
            elif self.in_state("evaluating"):
                self.close_evaluation(self.in_state("evaluating")[0], Outcome.COMPLETED)
            elif self.where:
                self.end_harness(min(self.where), composed=False, outcome=Outcome.COMPLETED)
            else:
                assert self.wakes, f"stuck: nothing pending (w = {self.sched.waterlevel}, roles {self.roles})"
                self.now = max(self.now, min(self.wakes))
                self.tick()
        raise AssertionError(f"stuck: trainer version {self.trainer_version} < {target} after {DRAIN_EVENTS} events")

    def check_closed_once(self) -> None:
        """Every execution of a judged group closed exactly once; none closed twice anywhere."""
        assert max(self.closes.values(), default=0) <= 1
        for group, state in enumerate(self.group_state):
            if state != "open":
                assert all(self.closes[e] == 1 for e in range(group * self.per, (group + 1) * self.per)), group


def play(data: st.DataObject, spec: SchedSpec, driver_class: type[EventDriver] = EventDriver) -> EventDriver:
    """Random moves of `driver_class` (a subclass adds its own moves with `extra_move`), then a cooperative burst."""
    driver = driver_class(spec)
    driver.apply("start", driver.sched.start(0.0))
    for _ in range(data.draw(st.integers(0, RANDOM_MOVES), label="moves")):
        move = data.draw(st.sampled_from(driver.moves()))
        driver.now += data.draw(st.sampled_from([0.0, 0.0, 0.25, 1.0]))
        if driver.extra_move(move, data):
            continue
        if move == "end":
            driver.end_harness(
                data.draw(st.sampled_from(sorted(driver.where))),
                composed=data.draw(st.booleans()),
                outcome=data.draw(st.sampled_from(FINISH_OUTCOMES)),
            )
        elif move == "close":
            driver.close_evaluation(
                data.draw(st.sampled_from(driver.in_state("evaluating"))), data.draw(st.sampled_from(FINISH_OUTCOMES))
            )
        elif move == "race":
            driver.race(
                data.draw(st.sampled_from(sorted(driver.cancelled))),
                data.draw(st.sampled_from(["end", "close", "finish"])),
            )
        elif move == "verdict":
            driver.verdict(data.draw(st.sampled_from(driver.groups_in("judging"))), accept=data.draw(st.booleans()))
        elif move == "transition":
            driver.finish_transition(data.draw(st.sampled_from(sorted(driver.transitioning))))
        elif move == "claim":
            driver.claim()
        elif move == "step":
            driver.finish_step()
        elif move == "publish":
            driver.finish_publish()
        else:
            future = [w for w in driver.wakes if w > driver.now]
            driver.now += data.draw(st.sampled_from([0.25, 1.0, 4.0] + ([min(future) - driver.now] if future else [])))
            driver.tick()
    driver.drain_one_burst()
    driver.check_closed_once()
    return driver


@pytest.mark.parametrize("verdicts", [True, False], ids=["verdicts", "implied"])
@pytest.mark.parametrize("continuous", [False, True], ids=["boundary", "continuous"])
@pytest.mark.parametrize("mode", ["elastic", "colocate", "async"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_split_events_keep_counters_readiness_and_liveness(mode: str, continuous: bool, verdicts: bool, data):
    play(data, data.draw(sched_specs(mode, continuous, verdicts), label="spec"))
