"""Property tests of `claimed_group_set_aside`: a group the packer refuses after `claim_group` handed it over.

The random driver of test_sched_events_properties.py (its account of every execution and group, its checks after
EVERY event) plays one more move: it sets aside a group claimed into the current batch. After each set-aside it
checks that the batch's claim count went back down, the group is never claimed again, the staleness recorded at
its claim is withdrawn (one record per claimed group), boundary dispatch dispatches exactly one replacement for
it (`replaces=group`) and continuous dispatch none (the claim already dispatched one: (phi + mu) B groups stay
outstanding), and that when no rollout capacity is left and too few groups are ready for the batch a cell returns
to rollout (elastic: the last training cell, or the joining one once joined; colocate: every cell). At the end a
cooperative driver that still rejects and sets aside groups completes one more burst: never a deadlock.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sched_events_properties import EventDriver, play, sched_specs

from gyre.sched import BeginTransition, Dispatch, GroupState, Outcome, Role, SchedSpec

T, R, TO_T, TO_R = Role.TRAINING, Role.ROLLOUT, Role.TO_TRAINING, Role.TO_ROLLOUT
DRAIN_EVENTS = 8000
DRAIN_SET_ASIDES = 2  # the cooperative drain sets aside this many claimed groups, and rejects as many


class SetAsideDriver(EventDriver):
    def __init__(self, spec: SchedSpec) -> None:
        super().__init__(spec)
        self.claimed_now: list[int] = []  # groups claimed into the current batch
        self.left: set[int] = set()  # cells a set-aside sent back to rollout in the step in flight

    def claim(self) -> int | None:
        group = super().claim()
        if group is not None:
            self.claimed_now.append(group)
        assert len(self.claimed_now) == self.claimed_in_batch
        return group

    def finish_step(self) -> None:
        self.claimed_now, self.left = [], set()
        super().finish_step()

    def set_aside(self, group: int) -> None:
        spec, sched = self.spec, self.sched
        before_d, before_records = sched.d, len(sched.staleness.values)
        self.claimed_now.remove(group)
        self.group_state[group] = "set_aside"
        self.claimed_in_batch -= 1
        if not spec.continuous_dispatch:
            self.last_rejected = group  # the replacement must name it
        joining = [c for c, role in enumerate(self.roles) if role is TO_T]
        must_make_room = (
            spec.mode != "async"
            and self.rollout_capacity() == 0
            and len(self.groups_in("ready"))
            < spec.batch_groups
            - self.claimed_in_batch
            + spec.batch_groups * (spec.mu - self.trainer_version % spec.mu - 1)
            and TO_R not in self.roles
        )
        actions = sched.claimed_group_set_aside(self.now, group)
        returns = [a.cell for a in actions if isinstance(a, BeginTransition) and a.to is R]
        dispatches = [a for a in actions if isinstance(a, Dispatch)]
        if spec.continuous_dispatch:
            assert dispatches == [] and sched.d == before_d
        else:
            assert [(a.count, a.replaces) for a in dispatches] == [(1, group)]
        if must_make_room and spec.mode == "colocate":  # joining cells return once they have joined
            assert returns == [c for c, role in enumerate(self.roles) if role is T]
            self.left.update(joining)
        elif must_make_room and joining:
            assert returns == [], "a joining cell returns once it has joined"
            self.left.update(joining)
        elif must_make_room:
            assert returns == [max(c for c, role in enumerate(self.roles) if role is T)]
        else:
            assert returns == []
        self.left.update(returns)
        assert len(sched.staleness.values) == before_records - 1
        self.apply("claimed_group_set_aside", actions)
        assert sched.group_state(group) is GroupState.SET_ASIDE

    def check_to_training(self, cell: int) -> None:
        if cell in self.left and self.step_active:  # rejoins the step it left: w fits and no verdict is due
            w = len(self.in_state("queued")) + len(self.in_state("running"))
            assert w <= self.rollout_capacity() - self.spec.cell_capacity or self.spec.mode == "colocate"
            may_be_rejected = self.spec.buffer_verdicts and (self.groups_in("open") or self.groups_in("judging"))
            assert not may_be_rejected, "a replacement may still be rejected: it would have nowhere to run"
            return
        super().check_to_training(cell)

    def check_state(self, event: str) -> None:
        super().check_state(event)
        sched = self.sched
        for group, state in enumerate(self.group_state):
            assert sched.group_state(group).value == state, (group, state, event)
        assert sorted(sched.groups.set_aside) == self.groups_in("set_aside")
        assert len(sched.staleness.values) == len(self.groups_in("claimed")), "one staleness record per claim"
        if self.step_active:
            assert sched.claimed_in_batch == self.claimed_in_batch

    def moves(self) -> list[str]:
        return [*super().moves(), *(["set_aside"] if self.step_active and self.claimed_now else [])]

    def extra_move(self, move: str, data: st.DataObject) -> bool:
        if move != "set_aside":
            return False
        self.set_aside(data.draw(st.sampled_from(self.claimed_now)))
        return True

    def drain_one_burst(self) -> None:
        """A cooperative driver that still rejects and sets aside a few groups completes the next burst."""
        target, rejections, set_asides = self.trainer_version + self.spec.mu + 1, 0, 0
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
                reject = rejections < DRAIN_SET_ASIDES
                self.verdict(judging[0], accept=not reject)
                rejections += reject
            elif self.step_active and self.groups_in("ready") and (group := self.claim()) is not None:
                if set_asides < DRAIN_SET_ASIDES:
                    self.set_aside(group)
                    set_asides += 1
            elif self.in_state("evaluating"):
                self.close_evaluation(self.in_state("evaluating")[0], Outcome.COMPLETED)
            elif self.where:
                self.end_harness(min(self.where), composed=False, outcome=Outcome.COMPLETED)
            else:
                assert self.wakes, f"stuck: nothing pending (w = {self.sched.waterlevel}, roles {self.roles})"
                self.now = max(self.now, min(self.wakes))
                self.tick()
        raise AssertionError(f"stuck: trainer version {self.trainer_version} < {target} after {DRAIN_EVENTS} events")


@pytest.mark.parametrize("verdicts", [True, False], ids=["verdicts", "implied"])
@pytest.mark.parametrize("continuous", [False, True], ids=["boundary", "continuous"])
@pytest.mark.parametrize("mode", ["elastic", "colocate", "async"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_set_aside_claims_keep_counters_staleness_and_liveness(mode: str, continuous: bool, verdicts: bool, data):
    play(data, data.draw(sched_specs(mode, continuous, verdicts), label="spec"), SetAsideDriver)


def test_colocate_k1_a_set_aside_claim_is_replaced_the_cell_leaves_to_run_it_and_rejoins_the_same_step():
    from gyre.sched import BeginStep, Scheduler, Start

    spec = SchedSpec(
        num_cells=1, cell_capacity=2, group_size=2, batch_groups=1, extra_groups=0, mu=1, rho_min=1.0, tau_s=0.0,
        mode="colocate", buffer_verdicts=True,
    )  # fmt: skip
    s = Scheduler(spec)
    assert s.start(0.0) == [Dispatch(0, 1, 0), Start(0, 0), Start(1, 0)]
    for e in (0, 1):
        s.harness_ended(1.0, e)
        s.execution_closed(1.0, e, Outcome.COMPLETED, 5.0)
    assert s.group_state(0) is GroupState.JUDGING
    actions = s.group_accepted(1.0, 0)
    assert actions == [BeginTransition(0, T)]
    assert s.transition_finished(2.0, 0) == [BeginStep(0)]
    assert s.claim_group(2.0) == (0, [])
    assert s.staleness.values == [0]
    actions = s.claimed_group_set_aside(2.5, 0)
    assert actions == [Dispatch(1, 1, 0, replaces=0), BeginTransition(0, R)]  # nowhere else to run it
    assert (s.claimed_in_batch, s.staleness.values, s.group_state(0)) == (0, [], GroupState.SET_ASIDE)
    assert s.claim_group(2.5) == (None, [])  # the step's trainer is out
    assert s.transition_finished(3.0, 0) == [Start(2, 0), Start(3, 0)]
    for e in (2, 3):
        s.harness_ended(4.0, e)
        s.execution_closed(4.0, e, Outcome.COMPLETED, 7.0)
    assert s.group_accepted(4.0, 1) == [BeginTransition(0, T)]  # no supply timer: back to the step it left
    assert s.transition_finished(5.0, 0) == []  # the step is still in flight: no new BeginStep
    assert s.claim_group(5.0) == (1, [])
    assert s.staleness.values == [0] and s.staleness.tokens == [14.0]
    s.step_finished(6.0)
    assert s.trainer_version == 1 and s.groups.set_aside == [0]
    with pytest.raises(ValueError, match="group 9 was never dispatched"):
        s.group_state(9)
