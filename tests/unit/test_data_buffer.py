"""The trajectory buffer: selection order, hand-out once, rewards from outcomes, and bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest

from gyre.data import TrajectoryBuffer
from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree
from gyre.traj.admission import AdmittedTrajectory
from gyre.traj.outcomes import CloseKind, EvaluatedState, Evaluation, GroupOutcomes, Validity


def one_call_tree(execution: str) -> TrajectoryTree:
    """Path of leaf 2: [1 2 | 20 21] (4 tokens, targets at 2 and 3)."""
    tree = TrajectoryTree(execution, 100)
    tree.insert(
        [Segment(Provenance.SYSTEM, [1, 2])], Response.build([20, 21], [-0.2, -0.21], "stop"), CallMeta(execution, "r0")
    )
    return tree


def full(execution: str) -> AdmittedTrajectory:
    return AdmittedTrajectory(execution, 2, "main", np.array([False, False, True, True]))


def ready_group(buffer: TrajectoryBuffer, group_id: int, version: int, executions: list[str]) -> None:
    buffer.add_group(group_id, version, executions)
    for e in executions:
        buffer.attach_tree(one_call_tree(e))
    buffer.mark_ready(group_id, dict.fromkeys(executions, 1.0), {e: [full(e)] for e in executions})


def test_ready_groups_leave_oldest_version_first_then_in_ready_order():
    buffer = TrajectoryBuffer()
    for group_id, version in ((0, 1), (1, 0), (2, 0), (3, 2)):
        buffer.add_group(group_id, version, [f"g{group_id}"])
    for group_id in (3, 2, 0, 1):  # ready order
        buffer.attach_tree(one_call_tree(f"g{group_id}"))
        buffer.mark_ready(group_id, {f"g{group_id}": 0.5}, {f"g{group_id}": [full(f"g{group_id}")]})
    assert buffer.ready_groups() == [2, 1, 0, 3]
    taken = [buffer.take_oldest_ready() for _ in range(4)]
    assert [g.group_id for g in taken] == [2, 1, 0, 3]
    assert [g.version for g in taken] == [0, 0, 1, 2]
    assert buffer.take_oldest_ready() is None and len(buffer) == 0


def test_the_choice_follows_the_schedulers_rule_oldest_version_then_ready_order():
    # The rule of gyre.sched.Scheduler.claim_group (its heap of (v_d, ready order, group)), stated as a sort.
    events = [(0, 3), (1, 1), (2, 3), (3, 0), (4, 1), (5, 0)]  # (group, v_d), listed in ready order
    buffer = TrajectoryBuffer()
    for group_id, version in events:
        ready_group(buffer, group_id, version, [f"x{group_id}"])
    rule_order = [group for order, (group, version) in sorted(enumerate(events), key=lambda e: (e[1][1], e[0]))]
    assert rule_order == [3, 5, 1, 4, 0, 2]
    assert [buffer.take_oldest_ready().group_id for _ in events] == rule_order


def test_a_group_is_handed_out_once():
    buffer = TrajectoryBuffer()
    ready_group(buffer, 7, 0, ["a"])
    assert buffer.take(7).members == ("a",)
    with pytest.raises(ValueError, match="group 7 was already handed out"):
        buffer.take(7)
    with pytest.raises(ValueError, match="already handed out"):
        buffer.mark_ready(7, {"a": 1.0}, {})
    with pytest.raises(ValueError, match="never reused"):
        buffer.add_group(7, 0, ["z"])


def test_rewards_come_from_group_outcomes():
    outcomes = ready_outcomes(2, ["a", "b", "c"], {"b": 0.25, "a": 0.75})
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a", "b", "c"], group_size=2)
    for e in "abc":
        buffer.attach_tree(one_call_tree(e))
    buffer.mark_ready_from_outcomes(0, outcomes, {"a": [full("a")], "b": [full("b")]})
    group = buffer.take(0)
    assert group.rewards == {"a": 0.75, "b": 0.25} and group.group_size == 2


def test_rewards_missing():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a", "b"])
    with pytest.raises(ValueError, match="not ready: rewards missing"):
        buffer.take(0)
    with pytest.raises(ValueError, match="rewards of group 0 are missing"):
        buffer.mark_ready(0, {}, {})
    with pytest.raises(ValueError, match="'b', which has no reward"):
        buffer.mark_ready(0, {"a": 1.0}, {"b": [full("b")]})
    with pytest.raises(ValueError, match="group is not ready"):
        buffer.mark_ready_from_outcomes(0, GroupOutcomes(2, ["a", "b"]), {})
    assert buffer.ready_groups() == [] and not buffer.group(0).ready


def test_bad_trajectories_are_rejected_and_nothing_changes():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a", "b"])
    buffer.attach_tree(one_call_tree("a"))
    short = AdmittedTrajectory("a", 2, "main", np.array([False, True, True]))
    with pytest.raises(ValueError, match="targets has 3 entries but the path to leaf 2 has 4 tokens"):
        buffer.mark_ready(0, {"a": 1.0, "b": 0.0}, {"a": [short]})
    with pytest.raises(ValueError, match="belongs to execution 'b'"):
        buffer.mark_ready(0, {"a": 1.0, "b": 0.0}, {"a": [full("b")]})
    with pytest.raises(ValueError, match="no tree attached"):
        buffer.mark_ready(0, {"a": 1.0, "b": 0.0}, {"b": [full("b")]})
    with pytest.raises(ValueError, match="leaf 9 is not a node"):
        buffer.mark_ready(0, {"a": 1.0}, {"a": [AdmittedTrajectory("a", 9, "main", np.ones(4, bool))]})
    with pytest.raises(ValueError, match="admitted twice"):
        buffer.mark_ready(0, {"a": 1.0}, {"a": [full("a"), full("a")]})
    with pytest.raises(ValueError, match="finite number or None"):
        buffer.mark_ready(0, {"a": float("nan")}, {})
    with pytest.raises(ValueError, match="not in group 0"):
        buffer.mark_ready(0, {"zz": 1.0}, {})
    assert not buffer.group(0).ready
    # An excluded member's trajectories are accepted and dropped: it trains nothing.
    buffer.mark_ready(0, {"a": 1.0, "b": None}, {"a": [full("a")], "b": [full("b")]})
    assert buffer.group(0).admitted.keys() == {"a"}


def test_registration_errors():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a"])
    with pytest.raises(ValueError, match="already belong to group 0"):
        buffer.add_group(1, 0, ["a"])
    with pytest.raises(ValueError, match="distinct"):
        buffer.add_group(1, 0, ["b", "b"])
    with pytest.raises(ValueError, match="unknown execution 'q'"):
        buffer.attach_tree(one_call_tree("q"))
    buffer.attach_tree(one_call_tree("a"))
    with pytest.raises(ValueError, match="different tree"):
        buffer.attach_tree(one_call_tree("a"))
    with pytest.raises(ValueError, match="unknown group 5"):
        buffer.take(5)


def ready_outcomes(group_size: int, executions: list, scores: dict) -> GroupOutcomes:
    outcomes = GroupOutcomes(group_size, executions)
    for e in executions:
        outcomes.start(e, 10.0)
    for e, score in scores.items():
        state = EvaluatedState(execution=e, artifact_version="v1", branch="main")
        outcomes.close(e, CloseKind.COMPLETED, now=1.0, final_state=state)
        outcomes.record(
            Evaluation(
                score=score,
                validity=Validity.VALID,
                state=state,
                attempt=1,
                evaluator="t",
                evaluator_version="1",
                created_at=2.0,
            )
        )
    return outcomes


def test_int_execution_ids_of_outcomes_are_converted_to_the_buffers_str_ids():
    # The scheduler's integer execution indices in GroupOutcomes; the trees (and the buffer) use str ids.
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["0", "1"])
    for e in ("0", "1"):
        buffer.attach_tree(one_call_tree(e))
    buffer.mark_ready_from_outcomes(0, ready_outcomes(2, [0, 1], {1: 0.25, 0: 0.75}), {"0": [full("0")]})
    group = buffer.take(0)
    assert group.rewards == {"1": 0.25, "0": 0.75} and group.admitted.keys() == {"0"}


def test_outcomes_of_other_executions_name_both_sides():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["q0-a", "q0-b"])
    message = (
        "the outcomes' members [0, 1] (as buffer ids ['0', '1']) do not match the executions of group 0: "
        "['q0-a', 'q0-b']; not in the group: ['0', '1']"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        buffer.mark_ready_from_outcomes(0, ready_outcomes(2, [0, 1], {1: 0.25, 0: 0.75}), {})
    assert not buffer.group(0).ready


def test_a_refused_group_is_dropped_its_trees_and_members_released_and_its_id_stays_used():
    buffer = TrajectoryBuffer(max_row_tokens=3)  # the rows of one_call_tree have 4 tokens: mark_ready refuses them
    buffer.add_group(3, 0, ["a", "b"])
    for e in ("a", "b"):
        buffer.attach_tree(one_call_tree(e))
    with pytest.raises(ValueError, match="max_row_tokens=3"):
        buffer.mark_ready(3, {"a": 1.0, "b": 0.0}, {"a": [full("a")], "b": [full("b")]})
    buffer.add_group(5, 0, ["c"])
    dropped = buffer.drop_group(3)
    assert dropped.group_id == 3 and list(dropped.trees) == ["a", "b"] and not dropped.ready
    assert len(buffer) == 1 and buffer.num_dropped == 1 and buffer.ready_groups() == []
    assert repr(buffer) == "TrajectoryBuffer(groups=1, ready=0, taken=0, dropped=1)"
    with pytest.raises(ValueError, match=r"unknown group 3 \(dropped\)"):
        buffer.group(3)
    with pytest.raises(ValueError, match="unknown execution 'a'"):  # its members are released
        buffer.attach_tree(one_call_tree("a"))
    with pytest.raises(ValueError, match="never reused"):
        buffer.add_group(3, 0, ["z"])
    buffer.add_group(6, 0, ["a", "b"])  # released execution ids may be registered again, in a new group
    assert buffer.group(6).trees == {"a": None, "b": None}


def test_dropping_twice_a_taken_a_ready_or_an_unknown_group_is_an_error_and_changes_nothing():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a"])
    buffer.drop_group(0)
    with pytest.raises(ValueError, match="group 0 was already dropped"):
        buffer.drop_group(0)
    ready_group(buffer, 1, 0, ["b"])
    with pytest.raises(ValueError, match="group 1 is ready and may be claimed"):
        buffer.drop_group(1)
    assert buffer.ready_groups() == [1] and buffer.group(1).ready
    buffer.take(1)
    with pytest.raises(ValueError, match="cannot drop group 1: it was already handed out"):
        buffer.drop_group(1)
    with pytest.raises(ValueError, match="unknown group 9"):
        buffer.drop_group(9)
    assert (len(buffer), buffer.num_dropped) == (0, 1)
