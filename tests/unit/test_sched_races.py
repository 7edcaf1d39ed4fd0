"""Races a real driver meets: a harness finishing while the scheduler cancels it as surplus."""

from gyre.sched import Cancel, Outcome, SchedSpec, Scheduler, Start


def test_finish_that_races_its_cancellation_is_ignored():
    spec = SchedSpec(
        num_cells=2, cell_capacity=8, group_size=1, oversample=1, batch_groups=1, extra_groups=0, mu=1,
        rho_min=1.0, tau_s=0.0,
    )  # fmt: skip
    sched = Scheduler(spec)
    started = [a.execution for a in sched.start(0.0) if isinstance(a, Start)]
    assert started == [0, 1]  # one group: N = 1 plus one surplus
    actions = sched.execution_finished(1.0, 0, Outcome.COMPLETED, tokens=10.0)
    assert Cancel(1) in actions
    counters = (sched.d, sched.p, sched.f)
    assert sched.execution_finished(1.5, 1, Outcome.COMPLETED, tokens=5.0) == []
    assert (sched.d, sched.p, sched.f) == counters
    assert sched.outcomes == {"completed": 1, "cancelled": 1}
    assert sched.groups[0].tokens == 10.0
