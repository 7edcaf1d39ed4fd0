"""Exact, hand-computed checks of the scheduling policy (`gyre.sched`).

Every spec is tiny (K = 1..3 cells, C_e = 2..4, N = 2, B = 1..2) so each expected action list can be
worked out on paper from the rules in the paper summary: Eq. 1 (ledger), boundary dispatch, Eq. 2
with the supply check held for tau, serial core-first transitions, Eq. 3 at burst end, the colocate
whole-pool switch, the async static split, oversampling and staleness. Placement fills the separate
pool first, then rollout cells in reverse index order, so with C_s = 0 and K = 2 the first C_e
executions land on cell 1 and the next C_e on the core (cell 0).
"""

from __future__ import annotations

import math

from gyre.sched import (
    POOL,
    BeginStep,
    BeginTransition,
    Cancel,
    CapacityLedger,
    Dispatch,
    Outcome,
    Publish,
    Reroute,
    Role,
    SchedSpec,
    Scheduler,
    StalenessLog,
    Start,
    WakeAt,
)

T, R = Role.TRAINING, Role.ROLLOUT
OK = Outcome.COMPLETED


def make(**overrides) -> Scheduler:
    """Elastic, K=2, C_e=2, C_s=0, N=2, B=1, phi=0, mu=1, rho_min=1, tau=0 unless overridden."""
    fields = dict(
        num_cells=2,
        cell_capacity=2,
        separate_capacity=0,
        group_size=2,
        batch_groups=1,
        extra_groups=0,
        mu=1,
        rho_min=1.0,
        tau_s=0.0,
    )
    fields.update(overrides)
    return Scheduler(SchedSpec(**fields))


def finish(sched: Scheduler, now: float, *executions: int, outcome: Outcome = OK) -> list:
    """Finish executions in order; return the actions of the last one."""
    actions: list = []
    for execution in executions:
        actions = sched.execution_finished(now, execution, outcome)
    return actions


# -- Eq. 1 and placement ------------------------------------------------------------------------------


def test_ledger_eq1_counts_only_rollout_cells():
    # C_R = C_s + (K - k) C_e with k the cells not serving rollout (training or in a transition).
    ledger = CapacityLedger(3, 4, 5, [R, R, R])
    assert ledger.rollout_capacity() == 5 + 3 * 4 == 17
    for roles, k in (([T, R, R], 1), ([Role.TO_TRAINING, R, R], 1), ([T, Role.TO_ROLLOUT, R], 2), ([T, T, T], 3)):
        ledger = CapacityLedger(3, 4, 5, roles)
        assert ledger.rollout_capacity() == 5 + (3 - k) * 4
    assert make(num_cells=3, cell_capacity=4, separate_capacity=5).rollout_capacity() == 17


def test_placement_fills_pool_then_cells_in_reverse_index_order():
    ledger = CapacityLedger(3, 2, 1, [R, R, R])
    assert ledger.destinations() == [POOL, 2, 1, 0]
    assert [ledger.place(e) for e in range(7)] == [POOL, 2, 2, 1, 1, 0, 0]
    assert ledger.place(7) is None  # C_R = 1 + 3 * 2 = 7 slots, all taken
    assert ledger.running == 7
    # Without a separate pool the pool is never a destination; a training cell never is either.
    assert CapacityLedger(3, 2, 0, [T, R, R]).destinations() == [2, 1]


def test_evacuation_reroutes_to_pool_first_then_highest_rollout_cell_with_room():
    ledger = CapacityLedger(3, 2, 1, [R, R, R])
    for e in range(7):  # pool {0}, cell 2 {1, 2}, cell 1 {3, 4}, cell 0 {5, 6}
        ledger.place(e)
    ledger.remove(0)  # frees the pool slot
    ledger.remove(3)  # frees one slot on cell 1; cell 2 stays full
    ledger.roles[0] = Role.TO_TRAINING
    assert ledger.evacuate(0) == [Reroute(5, 0, POOL), Reroute(6, 0, 1)]
    assert [ledger.load(e) for e in (POOL, 0, 1, 2)] == [1, 0, 2, 2]
    assert ledger.engine_of(6) == 1


# -- boundary dispatch, starts and the waterlevel -----------------------------------------------------


def test_initial_dispatch_and_starts_are_bounded_by_capacity():
    # (phi + mu) N B with phi B = 1 group and mu B = 4 groups: 5 groups of N = 2, d = 10 executions.
    sched = make(cell_capacity=3, separate_capacity=1, batch_groups=2, extra_groups=1, mu=2)
    actions = sched.start(0.0)
    assert actions[0] == Dispatch(first_group=0, count=5, version=0)
    starts = [a for a in actions if isinstance(a, Start)]
    # min(d - p, C_R - (p - f)) = min(10, 1 + 2 * 3) = 7, placed pool, cell 1 x3, cell 0 x3.
    assert [(s.execution, s.engine) for s in starts] == [(0, POOL), (1, 1), (2, 1), (3, 1), (4, 0), (5, 0), (6, 0)]
    assert (sched.d, sched.p, sched.f, sched.queued, sched.running, sched.waterlevel) == (10, 7, 0, 3, 7, 10)
    # One slot frees: min(3, 7 - 6) = 1 start, on the engine that freed.
    assert finish(sched, 1.0, 0) == [Start(7, POOL)]
    assert (sched.d, sched.p, sched.f, sched.waterlevel) == (10, 8, 1, 9)


def test_starts_are_bounded_by_queue_when_capacity_is_ample():
    sched = make(cell_capacity=4)  # d = 2 executions, C_R = 8: min(2, 8) = 2
    assert sched.start(0.0) == [Dispatch(0, 1, 0), Start(0, 1), Start(1, 1)]
    assert (sched.queued, sched.running) == (0, 2)


def test_mu_n_b_dispatched_after_each_publication_and_d_constant_in_burst():
    sched = make(num_cells=1, cell_capacity=4, mu=2)  # d(0) = mu N B = 2 * 2 * 1 = 4
    assert sched.start(0.0) == [Dispatch(0, 2, 0), *(Start(e, 0) for e in range(4))]
    assert finish(sched, 1.0, 0, 1, 2) == []  # w = 1 > C_R - C_e = 0
    assert finish(sched, 2.0, 3) == [BeginTransition(0, T)]  # w = 0 <= 0, one ready group >= rho_min B
    assert sched.transition_finished(3.0, 0) == [BeginStep(0)]
    assert sched.claim_group(4.0) == (0, [])
    assert sched.step_finished(5.0) == [BeginStep(1)]  # mu = 2: the burst goes on
    assert sched.claim_group(6.0) == (1, [])
    assert sched.d == 4  # constant within the burst
    # Burst end: no ready group for the next batch, so the core returns (the supply check fails).
    assert sched.step_finished(7.0) == [Publish(2), BeginTransition(0, R)]
    assert sched.publish_finished(8.0) == [Dispatch(2, 2, 2)]  # mu N B = 4 more; no room while core is away
    assert (sched.d, sched.p) == (8, 4)
    assert sched.transition_finished(9.0, 0) == [Start(e, 0) for e in range(4, 8)]
    assert (sched.d, sched.p, sched.f, sched.waterlevel) == (8, 8, 4, 4)


# -- Eq. 2 and the supply check -------------------------------------------------------------------


def test_core_transition_waits_tau_for_supply_and_asks_to_be_woken():
    # d = (phi + mu) N B = 2 * 2 = 4: executions 0, 1 on cell 1 and 2, 3 on the core.
    sched = make(extra_groups=1, tau_s=10.0)
    sched.start(0.0)
    assert finish(sched, 1.0, 0) == []  # w = 3 > C_R - C_e = 2
    # w = 2 <= 2 (Eq. 2) and group 0 is ready: supply min(1, B=1) >= rho_min B = 1 since t = 2.
    assert finish(sched, 2.0, 1) == [WakeAt(12.0)]
    assert sched.eq2_holds() and sched.supply_ok()
    assert sched.tick(11.5) == [WakeAt(12.0)]  # one tick before the boundary: still waiting
    assert sched.roles == [R, R]
    # At the WakeAt time the core leaves; its executions move to cell 1 (reserved destination).
    assert sched.tick(12.0) == [BeginTransition(0, T), Reroute(2, 0, 1), Reroute(3, 0, 1)]
    assert sched.roles == [Role.TO_TRAINING, R]
    assert sched.rollout_capacity() == 2 and sched.ledger.load(1) == 2
    assert sched.transitions == [(12.0, 0, T)]


def test_core_transition_waits_for_eq2_when_supply_already_held():
    # phi * B = 2 groups: d = 6, C_R = 4, so 4 start and 2 queue.
    sched = make(extra_groups=2, tau_s=5.0)
    sched.start(0.0)
    assert finish(sched, 1.0, 0) == [Start(4, 1)]
    assert finish(sched, 2.0, 1) == [Start(5, 1), WakeAt(7.0)]  # group 0 ready: supply timer runs from 2
    assert sched.tick(7.0) == []  # supply held for tau, but w = 4 > C_R - C_e = 2
    assert finish(sched, 8.0, 2) == []  # w = 3 > 2: one event before the boundary
    assert finish(sched, 9.0, 3) == [BeginTransition(0, T)]  # w = 2 <= 2; the core is already empty
    assert sched.waterlevel == 2


def test_supply_check_counts_ready_groups_capped_by_batch_need():
    # rho_min B = 0.5 * 2 = 1 ready group needed; the cap is the groups the batch still needs.
    sched = make(num_cells=1, cell_capacity=4, batch_groups=2, rho_min=0.5)
    sched.start(0.0)
    assert (sched.supply(), sched.supply_ok()) == (0, False)
    finish(sched, 1.0, 0, 1)
    assert (sched.ready_unclaimed, sched.batch_need(), sched.supply()) == (1, 2, 1)


def test_elastic_transitions_are_serial_core_first_in_index_order():
    # K = 3, C_e = 2, B = 2, rho_min = 0.5: one ready group is enough supply. d = 4.
    sched = make(num_cells=3, batch_groups=2, rho_min=0.5)
    sched.start(0.0)  # executions 0, 1 on cell 2; 2, 3 on cell 1
    assert finish(sched, 1.0, 0) == []  # no ready group yet
    assert finish(sched, 2.0, 1) == [BeginTransition(0, T)]  # w = 2 <= 6 - 2
    # Eq. 2 would hold for cell 1 (w = 1 <= 4 - 2), but one transition at a time and no batch in flight.
    assert finish(sched, 3.0, 2) == []
    # The core finishes: a batch starts and cell 1 joins it; execution 3 moves to cell 2.
    assert sched.transition_finished(4.0, 0) == [BeginStep(0), BeginTransition(1, T), Reroute(3, 1, 2)]
    assert sched.claim_group(5.0) == (0, [])
    # w = 0 <= C_R - C_e = 0, but cell 1 is still moving: cell 2 waits.
    assert finish(sched, 6.0, 3) == []
    assert sched.transition_finished(7.0, 1) == [BeginTransition(2, T)]  # supply min(1, 2 - 1) = 1 >= 1
    assert sched.transition_finished(8.0, 2) == []
    assert sched.claim_group(9.0) == (1, [])
    # Burst end: satellites return; the core returns too (no ready group for the next batch).
    assert sched.step_finished(10.0) == [
        Publish(1),
        BeginTransition(1, R),
        BeginTransition(2, R),
        BeginTransition(0, R),
    ]
    assert [(cell, to) for _, cell, to in sched.transitions] == [(0, T), (1, T), (2, T), (1, R), (2, R), (0, R)]


def test_satellite_still_joining_at_burst_end_is_sent_back_when_join_finishes():
    sched = make(num_cells=3, batch_groups=2, rho_min=0.5)
    sched.start(0.0)
    finish(sched, 1.0, 0, 1)
    finish(sched, 2.0, 2)
    sched.transition_finished(3.0, 0)  # BeginStep(0) and cell 1 begins to join
    assert sched.roles == [T, Role.TO_TRAINING, R]
    sched.claim_group(4.0)
    finish(sched, 5.0, 3)
    sched.claim_group(6.0)
    # Burst ends while cell 1 is joining: it is not sent yet (it is not in TRAINING).
    assert sched.step_finished(7.0) == [Publish(1), BeginTransition(0, R)]
    assert sched.transition_finished(8.0, 1) == [BeginTransition(1, R)]
    assert sched.roles == [Role.TO_ROLLOUT, Role.TO_ROLLOUT, R]


# -- end of burst (Eq. 3) -----------------------------------------------------------------------------


def _burst_with_core_training(**overrides) -> Scheduler:
    """Run the first burst (B = 1, mu = 1) up to its last claim; the core trains."""
    sched = make(**overrides)
    sched.start(0.0)
    finish(sched, 1.0, 0, 1)
    assert sched.roles[0] is Role.TO_TRAINING
    assert sched.transition_finished(2.0, 0)[0] == BeginStep(0)
    assert sched.claim_group(3.0)[0] == 0
    return sched


def test_core_stays_when_supply_and_eq3_hold():
    # C_e = 4, phi * B = 1: d = 4, all on cell 1. After the core leaves, group 1 finishes on cell 1.
    sched = _burst_with_core_training(cell_capacity=4, extra_groups=1)
    finish(sched, 4.0, 2, 3)
    # Supply: 1 ready >= rho_min B = 1. Eq. 3: w + mu N B = 0 + 2 <= C_s + (K - 1) C_e = 4.
    assert sched.step_finished(5.0) == [Publish(1)]
    assert sched.roles == [T, R]
    assert sched.publish_finished(6.0) == [Dispatch(2, 1, 1), BeginStep(1), Start(4, 1), Start(5, 1)]
    # Group 1 was dispatched at version 0 and is consumed by the step with trainer version 1.
    assert sched.claim_group(7.0)[0] == 1
    assert sched.staleness.steps == [0, 1] and sched.staleness.values == [0, 1]


def test_core_returns_when_eq3_fails():
    # C_e = 2, phi * B = 2: d = 6 with 4 running. The core leaves at w = 2 <= 4 - 2.
    sched = make(extra_groups=2)
    sched.start(0.0)
    finish(sched, 1.0, 0, 1)  # starts 4 and 5 on cell 1; w = 4
    assert finish(sched, 2.0, 2, 3) == [BeginTransition(0, T)]
    sched.transition_finished(3.0, 0)
    assert sched.claim_group(4.0)[0] == 0
    # Supply holds (group 1 ready) but Eq. 3 fails: w + mu N B = 2 + 2 > 0 + 1 * 2.
    assert sched.supply_ok() is False  # the batch is full: it needs no more groups
    assert sched.step_finished(5.0) == [Publish(1), BeginTransition(0, R)]


def test_core_returns_when_supply_fails():
    sched = _burst_with_core_training(cell_capacity=4)  # phi = 0: nothing left for the next batch
    # Eq. 3 holds (0 + 2 <= 4) but no ready group for the next batch.
    assert sched.step_finished(4.0) == [Publish(1), BeginTransition(0, R)]


# -- colocate and async -----------------------------------------------------------------------------


def test_colocate_switches_whole_pool_only_when_waterlevel_fits_separate_pool():
    # K = 2, C_e = 2, C_s = 2, mu = 3: d = 6; pool {0, 1}, cell 1 {2, 3}, cell 0 {4, 5}.
    sched = make(mode="colocate", separate_capacity=2, mu=3)
    sched.start(0.0)
    assert finish(sched, 1.0, 2, 3) == []  # group 1 ready (supply holds) but w = 4 > C_s = 2
    assert finish(sched, 2.0, 4) == []  # w = 3 > 2: one event before
    assert finish(sched, 3.0, 5) == [BeginTransition(0, T), BeginTransition(1, T)]  # w = 2 <= 2
    assert sched.transition_finished(4.0, 0) == []  # a step needs every cell
    assert sched.transition_finished(5.0, 1) == [BeginStep(0)]


def test_colocate_evacuates_every_cell_into_the_separate_pool():
    sched = make(mode="colocate", separate_capacity=2, mu=2)  # d = 4: pool {0, 1}, cell 1 {2, 3}
    sched.start(0.0)
    assert finish(sched, 1.0, 0, 1) == [
        BeginTransition(0, T),
        BeginTransition(1, T),
        Reroute(2, 1, POOL),
        Reroute(3, 1, POOL),
    ]
    assert sched.rollout_capacity() == 2 and sched.ledger.load(POOL) == 2


def test_elastic_would_move_the_core_where_colocate_waits():
    # Same state as the colocate test at w = 4: Eq. 2 holds for one cell (4 <= 6 - 2).
    sched = make(separate_capacity=2, mu=3)
    sched.start(0.0)
    assert finish(sched, 1.0, 2, 3) == [BeginTransition(0, T), Reroute(4, 0, 1), Reroute(5, 0, 1)]


def test_async_keeps_its_static_split_and_never_transitions():
    sched = make(mode="async", train_cells=1, extra_groups=1, tau_s=3.0)
    assert sched.roles == [T, R] and sched.rollout_capacity() == 2
    # (phi + mu) B = 2 groups; the trainer starts at once; cell 1 rolls out 2 executions.
    assert sched.start(0.0) == [Dispatch(0, 2, 0), BeginStep(0), Start(0, 1), Start(1, 1)]
    assert finish(sched, 1.0, 0) == [Start(2, 1)]
    assert finish(sched, 2.0, 1) == [Start(3, 1)]  # no WakeAt: async never waits on supply
    assert sched.claim_group(3.0)[0] == 0
    assert sched.step_finished(4.0) == [Publish(1)]
    assert sched.publish_finished(5.0) == [Dispatch(2, 1, 1), BeginStep(1)]
    finish(sched, 6.0, 2, 3)
    assert sched.tick(100.0) == []
    assert sched.roles == [T, R] and sched.transitions == []


# -- oversampling, outcomes and staleness -------------------------------------------------------------


def test_oversampling_cancels_every_running_surplus_once_n_closed():
    # N = 2, oversample = 2: 4 executions per group, all running on the core.
    sched = make(num_cells=1, cell_capacity=4, oversample=2)
    sched.start(0.0)
    assert finish(sched, 1.0, 0) == []
    assert finish(sched, 2.0, 1, outcome=Outcome.FAILED) == [Cancel(2), Cancel(3), BeginTransition(0, T)]
    assert (sched.d, sched.p, sched.f, sched.running, sched.ledger.running) == (4, 4, 4, 0, 0)
    assert sched.ready_unclaimed == 1


def test_oversampling_cancels_queued_surplus_without_a_cancel_action():
    # C_e = 3: executions 0..2 start, 3 is queued. f counts every cancellation; p counts a queued one.
    sched = make(num_cells=1, cell_capacity=3, oversample=2)
    sched.start(0.0)
    # An overall timeout closes no group slot: after it, only one of N = 2 slots is closed.
    assert finish(sched, 1.0, 0, outcome=Outcome.OVERALL_TIMEOUT) == [Start(3, 0)]
    assert finish(sched, 2.0, 1) == []
    assert finish(sched, 3.0, 2, outcome=Outcome.HARNESS_TIMEOUT) == [Cancel(3), BeginTransition(0, T)]
    assert (sched.d, sched.p, sched.f) == (4, 4, 4)
    # C_e = 2: executions 0, 1 start; finishing 0 starts 2; finishing 1 cancels running 2 and queued 3.
    sched = make(num_cells=1, cell_capacity=2, oversample=2)
    sched.start(0.0)
    assert finish(sched, 1.0, 0) == [Start(2, 0)]
    assert (sched.p, sched.queued) == (3, 1)
    assert finish(sched, 2.0, 1) == [Cancel(2), BeginTransition(0, T)]
    assert (sched.d, sched.p, sched.f, sched.queued, sched.running) == (4, 4, 4, 0, 0)


def test_overall_timeout_counts_in_f_and_closes_the_group_without_tokens():
    sched = make(num_cells=1, cell_capacity=4)
    sched.start(0.0)
    sched.execution_finished(1.0, 0, OK, tokens=100.0)
    assert (sched.f, sched.waterlevel, sched.ready_unclaimed) == (1, 1, 0)
    sched.execution_finished(2.0, 1, Outcome.OVERALL_TIMEOUT, tokens=50.0)
    assert (sched.f, sched.waterlevel, sched.ready_unclaimed) == (2, 0, 1)
    assert sched.groups[0].tokens == 100.0 and sched.groups[0].slots == 1


def test_staleness_recorded_on_claim_is_trainer_minus_dispatch_version():
    # phi * B = 1: two groups at version 0. Burst 1 consumes group 0; the core stays (see Eq. 3 test).
    sched = _burst_with_core_training(cell_capacity=4, extra_groups=1)
    finish(sched, 4.0, 2, 3)
    sched.step_finished(5.0)
    sched.publish_finished(6.0)  # group 2 at version 1
    sched.execution_finished(7.0, 4, OK, tokens=30.0)
    sched.execution_finished(7.0, 5, OK, tokens=10.0)
    assert sched.claim_group(8.0)[0] == 1  # version 0, trainer 1: staleness 1
    sched.step_finished(9.0)  # core stays: Eq. 3 0 + 2 <= 4 and group 2 ready
    sched.publish_finished(10.0)
    assert sched.claim_group(11.0)[0] == 2  # version 1, trainer 2: staleness 1
    assert sched.staleness.steps == [0, 1, 2]
    assert sched.staleness.values == [0, 1, 1]
    assert sched.staleness.tokens == [0.0, 0.0, 40.0]


def test_staleness_summary_group_token_and_max():
    log = StalenessLog()
    log.record(0, 0, 100.0)
    log.record(0, 2, 300.0)
    log.record(1, 1, 100.0)
    # group mean (0 + 2 + 1) / 3 = 1; token mean (0 * 100 + 2 * 300 + 1 * 100) / 500 = 1.4; max 2.
    assert log.summary() == {"group_mean": 1.0, "token_mean": 1.4, "max": 2.0, "groups": 3}
    assert log.summary(skip_steps=1) == {"group_mean": 1.0, "token_mean": 1.0, "max": 1.0, "groups": 1}
    empty = log.summary(skip_steps=5)
    assert empty["groups"] == 0 and math.isnan(empty["group_mean"]) and math.isnan(empty["max"])
    zero_tokens = StalenessLog()
    zero_tokens.record(3, 2, 0.0)
    summary = zero_tokens.summary()
    assert summary["group_mean"] == 2.0 and math.isnan(summary["token_mean"])


def test_continuous_dispatch_replaces_each_claimed_group():
    sched = make(num_cells=1, cell_capacity=4, continuous_dispatch=True)
    sched.start(0.0)
    finish(sched, 1.0, 0, 1)
    sched.transition_finished(2.0, 0)
    # One group dispatched per claim at the published version; no room while the only cell trains.
    assert sched.claim_group(3.0) == (0, [Dispatch(1, 1, 0)])
    assert sched.step_finished(4.0) == [Publish(1), BeginTransition(0, R)]  # Eq. 3: w = 2 > 0
    assert sched.publish_finished(5.0) == []  # continuous: nothing dispatched at the boundary
    assert sched.d == 4
