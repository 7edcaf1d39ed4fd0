"""The scheduler's state at a step's end and a scheduler resumed from it (gyre/sched/checkpoint.py).

A small driver plays the runtime's part with a seeded random order of events (executions end and close, groups are
accepted or now and then rejected, transitions finish, steps claim their groups and finish), takes the state at a
step's end, and resumes from it through JSON, as a restarted run does:

- the counters are those of the re-dispatched executions counted as new ones: d + R, f + (running), p unchanged;
  the waterlevel grows by the executions whose harness had ended (they run again);
- closed executions are never started again, every re-dispatched one starts again, no group is claimed twice;
- the resumed scheduler runs to the end under the same driver (every mode, oversampling too), and the staleness log
  goes on from the saved one.
"""

from __future__ import annotations

import json
import random

import pytest

from gyre.sched import BeginStep, BeginTransition, Cancel, Dispatch, Outcome, Publish, SchedSpec, Start, WakeAt
from gyre.sched.checkpoint import resume, resumed_scheduler, scheduler_state
from gyre.sched.groups import GroupState
from gyre.sched.scheduler import Scheduler


class Driver:
    """Carries out actions at once except executions, which end in a seeded random order."""

    def __init__(self, sched: Scheduler, seed: int, *, reject_every: int = 0) -> None:
        self.sched, self.rng, self.now = sched, random.Random(seed), 0.0
        self.running: set[int] = set()
        self.evaluating: set[int] = set()
        self.transitions: list[int] = []
        self.wakes: list[float] = []
        self.steps_begun = 0
        self.started: list[int] = []
        self.claimed: list[int] = []
        self.reject_every, self.judged = reject_every, 0

    def apply(self, actions) -> None:
        for action in actions:
            match action:
                case Start():
                    self.running.add(action.execution)
                    self.started.append(action.execution)
                case Cancel():
                    self.running.discard(action.execution)
                    self.evaluating.discard(action.execution)
                case BeginTransition():
                    self.transitions.append(action.cell)
                case BeginStep():
                    self.steps_begun += 1
                case WakeAt():
                    self.wakes.append(action.time_s)
                case Publish() | Dispatch():
                    pass

    def judge(self) -> None:
        for group in range(len(self.sched.groups)):
            if self.sched.group_state(group) is GroupState.JUDGING:
                self.judged += 1
                rejected = self.reject_every and self.judged % self.reject_every == 0
                report = self.sched.group_rejected if rejected else self.sched.group_accepted
                self.apply(report(self.now, group))

    def event(self) -> bool:
        """One event; False when nothing can happen."""
        s = self.sched
        self.now += 1.0
        if s.publishing:
            self.apply(s.publish_finished(self.now))
            return True
        if self.transitions:
            self.apply(s.transition_finished(self.now, self.transitions.pop(0)))
            return True
        if s.step_active and s.claimed_in_batch < s.spec.batch_groups:
            group, actions = s.claim_group(self.now)
            self.apply(actions)
            if group is not None:
                self.claimed.append(group)
                return True
        if s.step_active and s.claimed_in_batch == s.spec.batch_groups:
            return False  # the caller finishes the step (or takes the state first)
        choices = sorted(self.running | self.evaluating)
        if choices:
            execution = self.rng.choice(choices)
            if execution in self.running:
                self.running.discard(execution)
                self.evaluating.add(execution)
                self.apply(s.harness_ended(self.now, execution))
            else:
                self.evaluating.discard(execution)
                outcome = self.rng.choice([Outcome.COMPLETED, Outcome.COMPLETED, Outcome.FAILED])
                self.apply(s.execution_closed(self.now, execution, outcome, 10.0))
                self.judge()
            return True
        if self.wakes:
            self.now = max(self.now, self.wakes.pop(0))
            self.apply(s.tick(self.now))
            return True
        return False

    def to_step_end(self, limit: int = 100_000) -> bool:
        """Events until a step's batch is full; False when the run is stuck."""
        for _ in range(limit):
            s = self.sched
            if s.step_active and s.claimed_in_batch == s.spec.batch_groups:
                return True
            if not self.event():
                return False
        raise AssertionError("no step end within the event limit")

    def finish_step(self) -> None:
        self.apply(self.sched.step_finished(self.now))


SPECS = {
    "elastic": SchedSpec(
        num_cells=3, cell_capacity=4, group_size=2, batch_groups=2, extra_groups=1, mu=2, rho_min=0.5, tau_s=0.0,
        buffer_verdicts=True,
    ),
    "elastic_oversampled": SchedSpec(
        num_cells=3, cell_capacity=6, group_size=2, oversample=1, batch_groups=2, extra_groups=2, mu=3, rho_min=1.0,
        tau_s=2.0, buffer_verdicts=True,
    ),
    "colocate": SchedSpec(
        num_cells=2, cell_capacity=4, group_size=2, batch_groups=2, extra_groups=0, mu=2, rho_min=1.0, tau_s=0.0,
        mode="colocate", buffer_verdicts=True,
    ),
    "async": SchedSpec(
        num_cells=3, cell_capacity=4, group_size=2, batch_groups=2, extra_groups=2, mu=1, rho_min=1.0, tau_s=0.0,
        mode="async", train_cells=1, continuous_dispatch=True, buffer_verdicts=True,
    ),
}  # fmt: skip


def run_steps(driver: Driver, steps: int) -> None:
    for _ in range(steps):
        assert driver.to_step_end(), "the run got stuck"
        driver.finish_step()


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("at_step", [1, 2, 3])
def test_a_scheduler_resumed_at_a_step_end_counts_its_reruns_as_new_executions_and_runs_on(name, seed, at_step):
    spec = SPECS[name]
    driver = Driver(Scheduler(spec), seed, reject_every=5)
    driver.apply(driver.sched.start(0.0))
    run_steps(driver, at_step - 1)
    assert driver.to_step_end()
    old = driver.sched
    state = json.loads(json.dumps(scheduler_state(old)))  # through JSON, as on disk
    closed = set(old._closed)
    again = sorted(driver.running | driver.evaluating)

    sched = resumed_scheduler(spec, state)
    assert sched.redispatched == tuple(again)
    assert (sched.d, sched.p, sched.f) == (old.d + len(again), old.p, old.f + len(driver.running))
    assert sched.waterlevel == old.waterlevel + len(driver.evaluating)
    assert sched.trainer_version == at_step and not sched.step_active
    assert sched.staleness.steps == old.staleness.steps and sched.staleness.values == old.staleness.values
    burst_end = at_step % spec.mu == 0
    assert sched.published_version == (at_step if burst_end else old.published_version)
    assert sched.step_in_burst == at_step % spec.mu

    resumed = Driver(sched, seed + 100, reject_every=5)
    resumed.claimed = list(driver.claimed)
    resumed.apply(resume(sched, 0.0))
    run_steps(resumed, 4)
    assert not closed & set(resumed.started), "a closed execution was started again"
    assert set(again) <= set(resumed.started) | sched._closed, "a re-dispatched execution never ran"
    assert len(resumed.claimed) == len(set(resumed.claimed)), "a group was claimed twice"
    assert sched.trainer_version == at_step + 4
    assert sched.d - sched.f == sched.waterlevel >= 0 and sched.p <= sched.d


def test_the_state_is_taken_at_a_step_end_only():
    spec = SPECS["elastic"]
    sched = Scheduler(spec)
    sched.start(0.0)
    with pytest.raises(ValueError, match="at a step's end"):
        scheduler_state(sched)


def test_a_state_of_another_version_is_refused():
    spec = SPECS["elastic"]
    driver = Driver(Scheduler(spec), 0)
    driver.apply(driver.sched.start(0.0))
    assert driver.to_step_end()
    state = scheduler_state(driver.sched)
    state["state_version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        resumed_scheduler(spec, state)
