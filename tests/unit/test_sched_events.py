"""Exact checks of the runtime's execution and group events (docs/scheduler.md, "Events the runtime reports").

`harness_ended` moves f when the harness process ends (its slot is freed and the waterlevel w = d - f drops
while the evaluation still runs); `execution_closed` gives the outcome later (slot accounting, surplus
Cancel at N slots, evaluations in flight included); with `buffer_verdicts` only `group_accepted` makes a
group ready, and `group_rejected` dispatches one replacement group. Tiny specs (K = 1..2, C_e = 1..3, N = 1..2)
so each action list is worked out by hand: placement fills rollout cells in reverse index order.
"""

from __future__ import annotations

import pytest

from gyre.sched import (
    BeginStep,
    BeginTransition,
    Cancel,
    Dispatch,
    GroupState,
    Outcome,
    Publish,
    Reroute,
    Role,
    SchedSpec,
    Scheduler,
    Start,
)

T = Role.TRAINING
OK = Outcome.COMPLETED


def make(**overrides) -> Scheduler:
    """Elastic, K=2, C_e=2, C_s=0, N=2, B=1, phi=0, mu=1, rho_min=1, tau=0 unless overridden."""
    fields = dict(
        num_cells=2, cell_capacity=2, separate_capacity=0, group_size=2, batch_groups=1, extra_groups=0, mu=1,
        rho_min=1.0, tau_s=0.0,
    )  # fmt: skip
    fields.update(overrides)
    return Scheduler(SchedSpec(**fields))


def finish(sched: Scheduler, now: float, *executions: int) -> list:
    actions: list = []
    for execution in executions:
        actions = sched.execution_finished(now, execution, OK, tokens=1.0)
    return actions


def counters(sched: Scheduler) -> tuple[int, int, int]:
    return sched.d, sched.p, sched.f


# -- harness end: f, the waterlevel and capacity --------------------------------------------------------


def test_f_moves_and_the_slot_is_freed_when_the_harness_ends_not_after_evaluation():
    sched = make(cell_capacity=1, batch_groups=2)  # 2 groups x 2 executions, C_R = 2
    assert sched.start(0.0) == [Dispatch(0, 2, 0), Start(0, 1), Start(1, 0)]
    assert sched.harness_ended(1.0, 0) == [Start(2, 1)]  # the freed slot starts the next queued execution
    assert counters(sched) == (4, 3, 1) and sched.evaluating == 1
    assert sched.waterlevel == 3 == sched.queued + sched.running  # harnesses only, not the evaluation
    assert sched.execution_closed(2.0, 0, OK, tokens=5.0) == []  # the evaluation moves no counter
    assert counters(sched) == (4, 3, 1) and sched.evaluating == 0 and sched.outcomes == {"completed": 1}
    assert sched.groups[0].closed == 1 and sched.ready_unclaimed == 0
    assert sched.harness_ended(3.0, 1) == [Start(3, 0)]
    assert sched.execution_closed(3.0, 1, OK, tokens=1.0) == [] and sched.ready_unclaimed == 1
    assert sched.groups[0].tokens == 6.0


def test_eq2_counts_ended_harnesses_out_so_the_core_joins_while_evaluations_run():
    sched = make(extra_groups=2)  # 3 groups: 6 executions, C_R = 4, Eq. 2: w <= C_R - C_e = 2
    sched.start(0.0)  # 0, 1 on cell 1; 2, 3 on the core; 4, 5 queued
    finish(sched, 1.0, 0, 1)  # group 0 ready: the supply check holds; 4, 5 start on cell 1
    assert sched.waterlevel == 4
    assert sched.harness_ended(2.0, 2) == [] and sched.waterlevel == 3
    # The core's last harness ends: w = 2 fits, and nothing is left on the core to reroute.
    assert sched.harness_ended(2.0, 3) == [BeginTransition(0, T)]
    assert sched.evaluating == 2 and sched.ledger.load(0) == 0


def test_execution_finished_is_harness_end_and_close_at_one_instant():
    by_parts, at_once = make(cell_capacity=1, batch_groups=2), make(cell_capacity=1, batch_groups=2)
    by_parts.start(0.0), at_once.start(0.0)
    parts = by_parts.harness_ended(1.0, 0) + by_parts.execution_closed(1.0, 0, OK, 2.0)
    assert parts == at_once.execution_finished(1.0, 0, OK, 2.0) == [Start(2, 1)]
    assert counters(by_parts) == counters(at_once) and by_parts.groups[0] == at_once.groups[0]


# -- surplus cancellation with evaluations in flight, and the races --------------------------------------


def test_surplus_is_cancelled_at_n_slots_evaluations_in_flight_included():
    sched = make(num_cells=1, cell_capacity=3, group_size=1, oversample=2)  # 3 executions on the core
    sched.start(0.0)
    assert sched.harness_ended(1.0, 1) == []  # 1 is evaluating
    assert sched.harness_ended(1.0, 0) == []
    actions = sched.execution_closed(2.0, 0, OK, tokens=7.0)  # N = 1 slot closed
    assert actions[:2] == [Cancel(1), Cancel(2)]  # 1: its evaluation is cancelled; 2: its harness
    assert counters(sched) == (3, 3, 3) and sched.evaluating == 0
    assert sched.outcomes == {"completed": 1, "cancelled": 2} and sched.ready_unclaimed == 1


def test_events_that_race_their_cancellation_are_no_ops():
    sched = make(num_cells=1, cell_capacity=3, group_size=1, oversample=2)
    sched.start(0.0)
    sched.harness_ended(1.0, 1)
    sched.execution_finished(2.0, 0, OK, tokens=7.0)  # cancels 1 (evaluating) and 2 (running)
    state = (counters(sched), sched.evaluating, dict(sched.outcomes), sched.groups[0].tokens, sched.ready_unclaimed)
    assert sched.execution_closed(2.5, 1, OK, tokens=5.0) == []  # an evaluation that ends after its Cancel
    assert sched.harness_ended(2.5, 2) == []  # a harness that ends after its Cancel ...
    assert sched.execution_closed(2.6, 2, Outcome.FAILED) == []  # ... and its evaluation
    assert sched.execution_finished(2.7, 2, OK) == []
    assert (counters(sched), sched.evaluating, dict(sched.outcomes), sched.groups[0].tokens, sched.ready_unclaimed) == (
        state
    )


def test_out_of_order_events_are_refused():
    sched = make(cell_capacity=1, batch_groups=2)
    sched.start(0.0)  # 0, 1 running; 2, 3 queued
    with pytest.raises(AssertionError, match="before harness_ended"):
        sched.execution_closed(1.0, 0, OK)
    with pytest.raises(AssertionError, match="without running"):
        sched.harness_ended(1.0, 2)  # still queued
    sched.harness_ended(1.0, 0)
    with pytest.raises(AssertionError, match="ended twice"):
        sched.harness_ended(1.0, 0)
    with pytest.raises(AssertionError, match="buffer_verdicts"):
        sched.group_accepted(1.0, 0)  # verdicts are implied without buffer_verdicts


# -- readiness after the buffers' verdict ------------------------------------------------------------------


def test_with_buffer_verdicts_a_closed_group_is_ready_only_once_accepted():
    sched = make(buffer_verdicts=True)
    sched.start(0.0)  # group 0: 0, 1 on cell 1
    assert finish(sched, 1.0, 0, 1) == []  # closed, not ready: no supply, no transition
    assert sched.groups[0].state is GroupState.JUDGING and sched.ready_unclaimed == 0
    assert sched.group_accepted(2.0, 0) == [BeginTransition(0, T)]
    assert sched.groups[0].state is GroupState.READY and sched.ready_unclaimed == 1
    assert sched.transition_finished(3.0, 0) == [BeginStep(0), BeginTransition(1, T)]  # w = 0: the satellite too
    group, _ = sched.claim_group(3.0)
    assert group == 0 and sched.groups[0].state is GroupState.CLAIMED
    with pytest.raises(AssertionError, match="accepted while claimed"):
        sched.group_accepted(3.0, 0)


def test_a_rejected_group_is_replaced_and_the_step_is_fed_by_the_replacement():
    sched = make(buffer_verdicts=True, batch_groups=2, rho_min=0.5)  # 2 groups; the supply check needs 1
    sched.start(0.0)  # 0, 1 on cell 1; 2, 3 on the core
    finish(sched, 1.0, 0, 1)
    assert sched.group_accepted(1.0, 0) == [BeginTransition(0, T), Reroute(2, 0, 1), Reroute(3, 0, 1)]
    assert sched.transition_finished(2.0, 0) == [BeginStep(0)]
    assert sched.claim_group(2.0)[0] == 0
    finish(sched, 3.0, 2, 3)
    assert sched.claim_group(3.0) == (None, [])  # group 1 closed but not judged
    # Rejected: one group dispatched in its place at the version published now, started on cell 1 at once.
    assert sched.group_rejected(4.0, 1) == [Dispatch(2, 1, 0, replaces=1), Start(4, 1), Start(5, 1)]
    assert counters(sched) == (6, 6, 4) and sched.groups.rejected == [1]
    assert sched.groups[2].replaces == 1
    finish(sched, 5.0, 4, 5)
    # Accepted: supply and Eq. 2 (w = 0) hold and nothing is left to judge, so the satellite may take the last slots.
    assert sched.group_accepted(5.0, 2) == [BeginTransition(1, T)]
    assert sched.claim_group(5.0)[0] == 2
    assert sched.step_finished(6.0)[0] == Publish(1)
    assert sched.staleness.values == [0, 0]


def test_colocate_without_a_separate_pool_switches_only_after_every_verdict():
    sched = make(mode="colocate", buffer_verdicts=True, batch_groups=2, rho_min=0.5)
    sched.start(0.0)
    finish(sched, 1.0, 0, 1)
    assert sched.group_accepted(1.0, 0) == []  # supply holds, but w = 2 > C_s = 0
    assert finish(sched, 2.0, 2, 3) == []  # w = 0, but group 1 may still be rejected: its replacement needs cells
    assert sched.group_rejected(3.0, 1) == [Dispatch(2, 1, 0, replaces=1), Start(4, 1), Start(5, 1)]
    finish(sched, 4.0, 4, 5)
    assert sched.group_accepted(4.0, 2) == [BeginTransition(0, T), BeginTransition(1, T)]


def test_the_last_rollout_cell_waits_for_every_verdict_so_a_replacement_can_run():
    sched = make(num_cells=1, buffer_verdicts=True, extra_groups=1)  # 2 groups on the core, C_e = 2
    sched.start(0.0)  # 0, 1 running; 2, 3 queued
    finish(sched, 1.0, 0, 1)  # 2, 3 start
    assert sched.group_accepted(1.0, 0) == []  # w = 2 > C_R - C_e = 0
    assert finish(sched, 2.0, 2, 3) == []  # w = 0 and the supply holds, but group 1 awaits its verdict
    assert sched.group_rejected(3.0, 1) == [Dispatch(2, 1, 0, replaces=1), Start(4, 0), Start(5, 0)]
    finish(sched, 4.0, 4, 5)
    assert sched.group_accepted(4.0, 2) == [BeginTransition(0, T)]


def test_without_buffer_verdicts_the_same_cell_moves_when_the_executions_close():
    sched = make(num_cells=1, extra_groups=1)
    sched.start(0.0)
    finish(sched, 1.0, 0, 1)
    assert finish(sched, 2.0, 2, 3) == [BeginTransition(0, T)]
