"""Property tests of the scheduling policy: a random driver plays every event the scheduler accepts.

The driver carries out the scheduler's actions the way the simulator does (`gyre/sim/simulator.py`)
and keeps its own account of everything it can see: roles, running executions and their engines,
pending transitions, step and publication, groups closed, ready and claimed, and the supply timer.
At each hypothesis-chosen move it finishes a running execution with a random outcome, finishes a
pending transition, claims a group, finishes a full step, finishes a publication, or advances time
and ticks (by a random amount or to a requested WakeAt). After EVERY event the invariants of the
paper's policy are checked against that independent account; at the end a cooperative driver must
complete at least one more burst (no reachable state is stuck).

Times are multiples of 0.25 s and tau a multiple of 0.25 s, so "held for tau" is compared exactly.
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
RANDOM_MOVES = 160  # events per example before the liveness drain
DRAIN_EVENTS = 4000  # bound on the cooperative drain (one burst needs at most ~ 2 * 7 * 3 * 5 finishes)


@st.composite
def sched_specs(draw, mode: str, continuous: bool, streaming: bool) -> SchedSpec:
    num_cells = draw(st.integers(1, 5))
    batch_groups = draw(st.integers(1, 3))
    group_size = draw(st.integers(1, 3))
    oversample = draw(st.integers(0, 2))
    per_group = group_size + oversample
    train_cells = draw(st.integers(1, num_cells)) if mode == "async" else 0
    cell_capacity = draw(st.integers(1, 6))
    separate_capacity = draw(st.one_of(st.just(0), st.integers(1, 8)))
    # As the config checks demand: the rollout side can run one whole group.
    rollout = separate_capacity + (num_cells - train_cells) * cell_capacity
    if rollout < per_group:
        separate_capacity += per_group - rollout
    return SchedSpec(
        num_cells=num_cells,
        cell_capacity=cell_capacity,
        separate_capacity=separate_capacity,
        group_size=group_size,
        oversample=oversample,
        batch_groups=batch_groups,
        extra_groups=0 if mode == "colocate" else draw(st.integers(0, 2 * batch_groups)),  # phi B, phi in 0..2
        mu=draw(st.integers(1, 4)),
        rho_min=draw(st.sampled_from([0.25, 0.5, 1.0])),
        tau_s=draw(st.sampled_from([0.0, 0.5, 1.25, 3.0])),
        mode=mode,
        continuous_dispatch=continuous,
        streaming=streaming,
        train_cells=train_cells,
    )


class Driver:
    """Carries out actions, keeps an independent account, and checks the invariants after each event."""

    def __init__(self, spec: SchedSpec) -> None:
        self.spec = spec
        self.sched = Scheduler(spec)
        self.per = spec.executions_per_group
        self.now = 0.0
        self.roles = list(self.sched.roles)
        self.initial_roles = list(self.roles)
        self.where: dict[int, int] = {}  # running execution -> engine
        self.transitioning: set[int] = set()
        self.publishing = False
        self.step_active = False
        self.trainer_version = 0
        self.published_version = 0
        self.claimed_in_batch = 0
        self.wakes: list[float] = []
        # Groups as the driver sees them.
        self.version: list[int] = []  # v_d per group
        self.started: collections.Counter[int] = collections.Counter()
        self.closed: collections.Counter[int] = collections.Counter()  # finished or cancelled (visible)
        self.slots: collections.Counter[int] = collections.Counter()  # valid outcome or placeholder
        self.claimed: set[int] = set()
        self.must_return: set[int] = set()  # satellites joining when the burst ended
        self.supply_since: float | None = None
        self.dispatched_since_publish = 0  # executions (colocate: at most mu N B per burst)
        self.last_counters = (0, 0, 0)
        self.bursts = 0

    # -- the driver's own account -----------------------------------------------------------------
    def surplus_closed(self, group: int) -> bool:
        """N slots closed: the scheduler has cancelled the rest, including executions never started."""
        return self.slots[group] >= self.spec.group_size

    def ready(self, group: int) -> bool:
        return self.surplus_closed(group) or self.closed[group] == self.per

    def ready_unclaimed(self) -> list[int]:
        return [g for g in range(len(self.version)) if g not in self.claimed and self.ready(g)]

    def supply(self) -> int:
        need = self.spec.batch_groups - self.claimed_in_batch if self.step_active else self.spec.batch_groups
        return min(len(self.ready_unclaimed()), need)

    def supply_ok(self) -> bool:
        return self.supply() >= self.spec.rho_min * self.spec.batch_groups - 1e-9

    def counters(self) -> tuple[int, int, int]:
        d = len(self.version) * self.per
        p = sum(self.per if self.surplus_closed(g) else self.started[g] for g in range(len(self.version)))
        f = sum(self.per if self.surplus_closed(g) else self.closed[g] for g in range(len(self.version)))
        return d, p, f

    def capacity_of(self, engine: int) -> int:
        if engine == POOL:
            return self.spec.separate_capacity
        return self.spec.cell_capacity if self.roles[engine] is R else 0

    def rollout_capacity(self) -> int:
        """Eq. 1 from the driver's roles."""
        return self.spec.separate_capacity + self.spec.cell_capacity * self.roles.count(R)

    # -- events -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.apply("start", self.sched.start(self.now))

    def finish_execution(self, execution: int, outcome: Outcome) -> None:
        group = execution // self.per
        del self.where[execution]
        self.closed[group] += 1
        if outcome.closes_group_slot:
            self.slots[group] += 1
        self.apply("execution_finished", self.sched.execution_finished(self.now, execution, outcome, tokens=1.0))

    def finish_transition(self, cell: int) -> None:
        self.transitioning.discard(cell)
        self.roles[cell] = T if self.roles[cell] is TO_T else R
        returning = cell in self.must_return
        self.must_return.discard(cell)
        actions = self.sched.transition_finished(self.now, cell)
        if returning:  # a joiner that arrived after its burst ended goes straight back
            assert BeginTransition(cell, R) in actions, (cell, actions)
        self.apply("transition_finished", actions, reset=True, sent_back=cell if returning else None)

    def claim(self) -> int | None:
        candidates = self.ready_unclaimed()
        group, actions = self.sched.claim_group(self.now)
        if group is not None:
            assert group in candidates, (group, candidates)
            assert self.version[group] == min(self.version[g] for g in candidates), "oldest version first"
            if not self.spec.streaming and self.claimed_in_batch == 0:
                assert len(candidates) >= self.spec.batch_groups, "non-streaming: the batch opens with B ready"
            self.claimed.add(group)
            self.claimed_in_batch += 1
            assert self.sched.staleness.values[-1] == self.trainer_version - self.version[group]
            assert self.sched.staleness.steps[-1] == self.trainer_version
        else:
            assert actions == []
        self.apply("claim_group", actions)
        return group

    def finish_step(self) -> None:
        self.step_active = False
        self.claimed_in_batch = 0
        self.trainer_version += 1
        self.apply("step_finished", self.sched.step_finished(self.now))

    def finish_publish(self) -> None:
        self.publishing = False
        self.published_version = self.trainer_version
        self.apply("publish_finished", self.sched.publish_finished(self.now))

    def tick(self) -> None:
        self.wakes = [w for w in self.wakes if w > self.now]  # served; the scheduler asks again if needed
        self.apply("tick", self.sched.tick(self.now))

    # -- carrying out actions and checking them ---------------------------------------------------
    def held_for_tau(self, since: float | None) -> bool:
        return since is not None and self.now - since >= self.spec.tau_s

    def apply(self, event: str, actions: list, reset: bool = False, sent_back: int | None = None) -> None:
        spec, K = self.spec, self.spec.num_cells
        published = transition_begun = False
        to_training = 0
        # The supply timer as the paper states it: the check must have held continuously for tau;
        # it restarts after every transition and at the start of every batch.
        ok = self.supply_ok()
        since = self.supply_since if (ok and self.supply_since is not None) else (self.now if ok else None)
        if reset:
            since = self.now if ok else None
        for action in actions:
            if isinstance(action, Dispatch):
                assert action.first_group == len(self.version)
                if spec.continuous_dispatch:
                    assert event == "start" or (event == "claim_group" and action.count == 1), (event, action)
                else:  # boundary: d changes only at the start and after a publication
                    assert event in ("start", "publish_finished"), (event, action)
                    if event == "publish_finished":
                        assert action.count == spec.mu * spec.batch_groups
                assert action.version == self.published_version  # v_d: the version published at admission
                self.version += [action.version] * action.count
                if event != "start" or not spec.continuous_dispatch:  # continuous: the initial fill stands
                    self.dispatched_since_publish += action.count * self.per
            elif isinstance(action, Start):
                group = action.execution // self.per
                assert action.execution not in self.where and not self.surplus_closed(group)
                assert action.engine == POOL or self.roles[action.engine] is R
                self.where[action.execution] = action.engine
                self.started[group] += 1
            elif isinstance(action, Reroute):
                assert self.where[action.execution] == action.source
                assert self.roles[action.source] is TO_T, "only a cell leaving for training is evacuated"
                assert action.destination == POOL or self.roles[action.destination] is R
                self.where[action.execution] = action.destination
            elif isinstance(action, Cancel):
                group = action.execution // self.per
                assert self.surplus_closed(group), "only the surplus beyond N is cancelled"
                del self.where[action.execution]
                self.closed[group] += 1
            elif isinstance(action, BeginTransition):
                if action.to is T:
                    self.check_to_training(action.cell, since, to_training)
                    to_training += 1
                else:
                    assert self.roles[action.cell] is T
                    assert published or action.cell == sent_back, "cells return only at burst end"
                self.roles[action.cell] = TO_T if action.to is T else TO_R
                self.transitioning.add(action.cell)
                transition_begun = True  # the timer restarts after this event's decisions (colocate: K)
            elif isinstance(action, BeginStep):
                assert not self.step_active and not self.publishing and action.step == self.trainer_version
                assert self.roles[0] is T
                if spec.mode == "colocate":
                    assert all(role is T for role in self.roles)
                self.step_active = True
                self.claimed_in_batch = 0
                ok = self.supply_ok()
                since = self.now if ok else None
            elif isinstance(action, Publish):
                assert event == "step_finished" and action.version == self.trainer_version
                assert self.trainer_version % spec.mu == 0
                self.publishing = published = True
            elif isinstance(action, WakeAt):
                assert spec.mode != "async" and action.time_s > self.now
                self.wakes.append(action.time_s)
            else:
                raise AssertionError(f"unknown action {action!r}")
        if spec.mode == "colocate":
            assert to_training in (0, K), "colocate switches the whole pool at once"
        if published:
            self.check_burst_end()
        # The timer after the event: it runs while the check holds, from the first event it held.
        ok = self.supply_ok()
        if transition_begun:
            since = self.now if ok else None
        self.supply_since = (since if since is not None else self.now) if ok else None
        # A supply timer still short of tau must be covered by a wake-up requested and not yet served
        # (a past-due one is owed by the driver, which ticks at max(time, now) like the simulator);
        # a transition or publication in flight calls back by itself.
        waiting = self.supply_since is not None and not self.held_for_tau(self.supply_since)
        if spec.mode != "async" and waiting and not self.transitioning and not self.publishing:
            due = self.supply_since + spec.tau_s
            assert any(w <= due for w in self.wakes), (self.now, due, self.wakes)
        self.check_state(event)

    def check_to_training(self, cell: int, since: float | None, earlier_in_event: int) -> None:
        spec = self.spec
        w = self.counters()[0] - self.counters()[2]
        assert spec.mode != "async", "async never transitions"
        assert self.roles[cell] is R
        assert self.supply_ok() and self.held_for_tau(since), (cell, since, self.now, spec.tau_s)
        if spec.mode == "colocate":
            assert w <= spec.separate_capacity, (w, spec.separate_capacity)  # Eq. 2 for the whole pool
            assert cell == earlier_in_event and all(r is R for r in self.roles[cell:])
            return
        # Elastic: Eq. 2 against C_R just before this transition; serial; core first; a growing prefix.
        assert w <= self.rollout_capacity() - spec.cell_capacity, (w, self.rollout_capacity())
        assert earlier_in_event == 0 and TO_T not in self.roles, "transitions are serial"
        assert all(role is T for role in self.roles[:cell]), ("core first, prefix", cell, self.roles)
        assert cell == 0 or self.step_active, "satellites join a batch in flight"

    def check_burst_end(self) -> None:
        spec = self.spec
        self.bursts += 1
        if spec.mode == "async":
            assert self.roles == self.initial_roles
        elif spec.mode == "colocate":
            assert all(role is TO_R for role in self.roles)
            assert self.dispatched_since_publish <= spec.burst_executions
        else:
            for cell in range(1, spec.num_cells):
                assert self.roles[cell] in (R, TO_R, TO_T), (cell, self.roles)
                if self.roles[cell] is TO_T:
                    self.must_return.add(cell)
            # The core stays only if the next batch has rho_min B ready groups and Eq. 3 holds.
            d, _, f = self.counters()
            upcoming = 0 if spec.continuous_dispatch else spec.burst_executions
            eq3 = (d - f) + upcoming <= spec.separate_capacity + (spec.num_cells - 1) * spec.cell_capacity
            assert self.roles[0] is (T if self.supply_ok() and eq3 else TO_R), (self.supply_ok(), eq3, self.roles)
        self.dispatched_since_publish = 0

    def check_state(self, event: str) -> None:
        spec, sched = self.spec, self.sched
        d, p, f = self.counters()
        assert (sched.d, sched.p, sched.f) == (d, p, f), ((sched.d, sched.p, sched.f), (d, p, f), event)
        last = self.last_counters
        assert d >= last[0] and p >= last[1] and f >= last[2], "counters never decrease"
        assert f <= p <= d
        if not spec.continuous_dispatch and event not in ("start", "publish_finished"):
            assert d == last[0], "boundary dispatch: d is constant between publications"
        self.last_counters = (d, p, f)
        # Running executions fit the rollout capacity (Eq. 1), engine by engine.
        assert sched.roles == self.roles
        assert p - f == sched.ledger.running == len(self.where) <= self.rollout_capacity() == sched.rollout_capacity()
        loads = collections.Counter(self.where.values())
        for engine in [POOL, *range(spec.num_cells)]:
            assert loads[engine] == sched.ledger.load(engine) <= self.capacity_of(engine), (engine, loads)
        assert sched.ready_unclaimed == len(self.ready_unclaimed()) and sched.supply() == self.supply()
        assert sched.step_active == self.step_active and sched.publishing == self.publishing
        if spec.continuous_dispatch:  # (phi + mu) B groups outstanding: every claim is replaced
            assert len(self.version) - len(self.claimed) == spec.extra_groups + spec.mu * spec.batch_groups
        if spec.mode == "colocate":
            assert self.dispatched_since_publish <= spec.burst_executions
        if spec.mode == "elastic":
            assert self.roles.count(TO_T) <= 1
            learning = [c for c, role in enumerate(self.roles) if role in (T, TO_T) and c not in self.must_return]
            assert learning == list(range(len(learning))), ("training cells form a prefix", self.roles)
        if spec.mode == "async":
            assert self.roles == self.initial_roles and not self.transitioning

    # -- moves ------------------------------------------------------------------------------------
    def moves(self) -> list[str]:
        moves = []
        if self.where:
            moves.append("finish")
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
        """A cooperative driver must complete the next burst: no reachable state is stuck."""
        target = self.trainer_version + self.spec.mu + 1
        for _ in range(DRAIN_EVENTS):
            if self.trainer_version >= target:
                return
            if self.publishing:
                self.finish_publish()
            elif self.step_active and self.claimed_in_batch == self.spec.batch_groups:
                self.finish_step()
            elif self.transitioning:
                self.finish_transition(min(self.transitioning))
            elif self.step_active and self.ready_unclaimed() and self.claim() is not None:
                continue
            elif self.where:
                self.finish_execution(min(self.where), Outcome.COMPLETED)
            else:  # like the simulator: with nothing in flight only a requested wake-up can help
                assert self.wakes, f"stuck: no event pending (w = {self.sched.waterlevel}, roles {self.roles})"
                self.now = max(self.now, min(self.wakes))
                self.tick()
        raise AssertionError(f"stuck: trainer version {self.trainer_version} < {target} after {DRAIN_EVENTS} events")


def play(data: st.DataObject, spec: SchedSpec) -> Driver:
    driver = Driver(spec)
    driver.start()
    for _ in range(data.draw(st.integers(0, RANDOM_MOVES), label="moves")):
        move = data.draw(st.sampled_from(driver.moves()))
        driver.now += data.draw(st.sampled_from([0.0, 0.0, 0.25, 1.0]))
        if move == "finish":
            execution = data.draw(st.sampled_from(sorted(driver.where)))
            driver.finish_execution(execution, data.draw(st.sampled_from(FINISH_OUTCOMES)))
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
            choices = [0.25, 1.0, 4.0] + ([min(future) - driver.now] if future else [])
            driver.now += data.draw(st.sampled_from(choices))
            driver.tick()
    driver.drain_one_burst()
    return driver


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "batch"])
@pytest.mark.parametrize("continuous", [False, True], ids=["boundary", "continuous"])
@pytest.mark.parametrize("mode", ["elastic", "colocate", "async"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_scheduler_invariants_hold_under_random_events(mode: str, continuous: bool, streaming: bool, data):
    spec = data.draw(sched_specs(mode, continuous, streaming), label="spec")
    play(data, spec)
