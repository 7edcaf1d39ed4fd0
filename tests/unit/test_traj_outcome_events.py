"""An execution's outcomes played on another node (`gyre.traj.outcome_events`): the events a `MirrorGroup`
writes, applied to the real group on another clock, leave that group exactly as the same calls made on it
directly (the execution's state, the group's members and surplus), and a malformed event is a ValueError."""

from __future__ import annotations

import json

import pytest

from gyre.traj.outcome_events import MirrorGroup, apply_event
from gyre.traj.outcomes import CloseKind, EvaluatedState, Evaluation, GroupOutcomes, Status, Validity
from gyre.traj.outcomes_state import group_outcomes_state

OFFSET = 1000.0  # the controller's clock runs this far ahead of the host's


def evaluation(execution, score, validity, attempt, at):
    state = EvaluatedState(execution=execution, artifact_version="v1", branch="gyre/x")
    return Evaluation(
        score=score, validity=validity, state=state, attempt=attempt, evaluator="t", evaluator_version="1",
        created_at=at, detail=None,
    )  # fmt: skip


def final(execution):
    return EvaluatedState(execution=execution, artifact_version="v1", branch="gyre/x")


def completed(group, e, t0):  # a harness that finished; a failed evaluation, then a valid one
    group.start(e, deadline=t0 + 100)
    group.close(e, CloseKind.COMPLETED, now=t0 + 10, final_state=final(e))
    group.record(evaluation(e, 0.0, Validity.FAILED, 1, t0 + 11))
    group.record(evaluation(e, 0.5, Validity.VALID, 2, t0 + 12))


def failed(group, e, t0):  # no workspace: a placeholder
    group.start(e, deadline=t0 + 100)
    group.close(e, CloseKind.FAILED, now=t0 + 1)


def expired(group, e, t0):  # never a valid score: excluded when the budget ends
    group.start(e, deadline=t0 + 100)
    group.close(e, CloseKind.HARNESS_TIMEOUT, now=t0 + 50, final_state=final(e))
    group.record(evaluation(e, 0.0, Validity.PENDING, 1, t0 + 51))
    group.expire(t0 + 100)


def cancelled(group, e, t0):  # surplus, cancelled while awaiting its evaluation
    group.start(e, deadline=t0 + 100)
    group.close(e, CloseKind.COMPLETED, now=t0 + 20, final_state=final(e))
    group.cancel(e, now=t0 + 21)


SCENARIOS = [completed, failed, expired, cancelled]


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]])
def test_events_applied_on_another_clock_leave_the_group_as_direct_calls_do(order):
    names = [f"e{i}" for i in range(4)]
    direct, mirrored = GroupOutcomes(2, names), GroupOutcomes(2, names)
    for i in order:
        SCENARIOS[i](direct, names[i], OFFSET)  # the controller's clock
        events = []
        mirror = MirrorGroup(names[i], events.append, now=lambda: 5.0)
        SCENARIOS[i](mirror, names[i], 0.0)  # the host's clock
        for event in events:
            apply_event(mirrored, json.loads(json.dumps(event)), offset=OFFSET)  # as sent: plain JSON
        assert mirror.execution(names[i]).status == direct.execution(names[i]).status
    assert group_outcomes_state(mirrored) == group_outcomes_state(direct)
    assert mirrored.members == direct.members and mirrored.surplus == direct.surplus
    assert mirrored.ready and mirrored.rewards() == direct.rewards()


def test_a_mirror_reads_its_own_execution_only_and_leaves_surplus_to_the_owners_cancel():
    mirror = MirrorGroup("e0", lambda event: None, now=lambda: 0.0)
    assert mirror.surplus == ()
    with pytest.raises(ValueError):
        mirror.execution("other")


@pytest.mark.parametrize(
    "event",
    [
        {"op": "explode", "execution": "e0"},
        {"op": "start", "execution": "nobody", "deadline": 1.0},
        {"op": "start", "execution": "e0"},
        {"op": "close", "execution": "e0", "kind": "sideways", "now": 1.0, "final_state": None},
        {"op": "record", "execution": "e0", "evaluation": {"score": 1.0}},
    ],
)
def test_a_malformed_event_is_a_value_error(event):
    with pytest.raises(ValueError):
        apply_event(GroupOutcomes(1, ["e0"]), event, offset=0.0)


def test_a_record_that_arrives_after_another_members_expiry_settled_it_is_dropped():
    """X (on another node) records just before its deadline; the event is on its way while Y's episode expires the
    group past that deadline, which excludes X (awaiting its score). X's record then comes too late: not applied,
    as an evaluation past the budget is not recorded beside the group either."""
    group = GroupOutcomes(2, ["x", "y"])
    events = []
    mirror = MirrorGroup("x", events.append, now=lambda: 0.0)
    mirror.start("x", deadline=10.0)
    mirror.close("x", CloseKind.COMPLETED, now=5.0, final_state=final("x"))
    mirror.record(evaluation("x", 1.0, Validity.VALID, 1, 9.9))
    start, close, record = events
    group.start("y", deadline=10.0)
    assert apply_event(group, start, offset=0.0) and apply_event(group, close, offset=0.0)
    group.expire(10.5)  # Y's episode, past the deadline both share
    assert group.execution("x").status is Status.EXCLUDED
    assert apply_event(group, record, offset=0.0) is False
    assert group.execution("x").status is Status.EXCLUDED
