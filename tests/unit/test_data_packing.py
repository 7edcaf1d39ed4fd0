"""Exact tests of materialization and packing with readable token ids.

Convention (as in test_traj_tree.py): system 1..9, user 10..19, tool results 30..39, our outputs 20..29
and 40..49. Every output token t is recorded with behavior log-prob -t / 100, so a row's behavior
log-probs can be read off its ids. Admission is not called: `admit_greedy` below admits every leaf in
creation order with the sampled tokens of nodes no earlier trajectory covered (disjoint targets).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.config import PackingConfig
from gyre.data import (
    MicroStep,
    StreamPackingBuffer,
    TrajectoryBuffer,
    first_fit_decreasing,
    materialize_group,
)
from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree
from gyre.traj.admission import AdmittedTrajectory

SYS, USR, TOOL = Provenance.SYSTEM, Provenance.USER, Provenance.TOOL


def out(*ids: int) -> Response:
    return Response.build(list(ids), [-i / 100 for i in ids], "stop")


def two_leaf_tree(execution: str, extra: int = 0) -> TrajectoryTree:
    """Shared prefix [1 2 3 | 10 11 | 20 21], then leaf 5: [30 | 40] and leaf 7: [31 | 41 42]; `extra`
    more tool tokens (33...) lengthen the second branch's context."""
    tree = TrajectoryTree(execution, 100)
    tree.insert([Segment(SYS, [1, 2, 3]), Segment(USR, [10, 11])], out(20, 21), CallMeta(execution, "r0"))
    tree.insert([Segment(TOOL, [30])], out(40), CallMeta(execution, "r1"), parent=3)
    tree.insert([Segment(TOOL, [31] + [33] * extra)], out(41, 42), CallMeta(execution, "r2"), parent=3)
    return tree


def admit_greedy(tree: TrajectoryTree, role: str = "main") -> list[AdmittedTrajectory]:
    """Every leaf in creation order; targets are the recorded sampled tokens of nodes not yet covered."""
    covered: set[int] = set()
    admitted = []
    for leaf in tree.leaves():
        path = tree.path_tokens(leaf)
        fresh = np.concatenate([np.full(tree.nodes[n].num_tokens, n not in covered) for n in tree.path(leaf)])
        covered.update(tree.path(leaf))
        admitted.append(AdmittedTrajectory(tree.execution, leaf, role, path.target_mask & fresh))
    return admitted


def add_ready_group(
    buffer: TrajectoryBuffer,
    group_id: int,
    version: int,
    rewards: dict[str, float | None],
    extra: int | dict[str, int] = 0,
) -> None:
    buffer.add_group(group_id, version, list(rewards))
    admitted = {}
    for e in rewards:
        tree = two_leaf_tree(e, extra if isinstance(extra, int) else extra.get(e, 0))
        buffer.attach_tree(tree)
        admitted[e] = admit_greedy(tree)
    buffer.mark_ready(group_id, rewards, admitted)


def config(**overrides) -> PackingConfig:
    fields = {"batch_groups": 2, "group_size": 2, "max_tokens_per_microstep": 20, "min_fill": 0.0}
    fields.update(overrides)
    return PackingConfig(**fields)


def drain(packer: StreamPackingBuffer) -> list[MicroStep]:
    steps = []
    while (step := packer.queue.claim(0)) is not None:
        steps.append(step)
    return steps


# -- materialization --------------------------------------------------------------------------------


def test_two_trajectories_with_a_shared_prefix_materialize_exactly():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0})
    rows = materialize_group(buffer.group(0))
    assert [(r.execution, r.leaf) for r in rows] == [("a", 5), ("a", 7), ("b", 5), ("b", 7)]
    first, second = rows[0], rows[1]
    assert first.ids.tolist() == [1, 2, 3, 10, 11, 20, 21, 30, 40]
    assert second.ids.tolist() == [1, 2, 3, 10, 11, 20, 21, 31, 41, 42]
    # The shared outputs 20 21 are targets of the first row only; each row's targets are its frozen mask.
    assert first.ids[first.targets].tolist() == [20, 21, 40]
    assert second.ids[second.targets].tolist() == [41, 42]
    admitted = buffer.group(0).admitted["a"]
    assert np.array_equal(first.targets, admitted[0].targets) and np.array_equal(second.targets, admitted[1].targets)
    # L_i is the execution's whole admitted target set, on every row of it.
    assert first.execution_num_targets == second.execution_num_targets == 3 + 2
    # Behavior log-probs align with the ids at targets and are 0 elsewhere.
    for row in rows:
        np.testing.assert_allclose(row.behavior_logprobs[row.targets], -row.ids[row.targets] / 100)
        assert not row.behavior_logprobs[~row.targets].any()
    assert [r.advantage for r in rows] == [0.5, 0.5, -0.5, -0.5]


def test_excluded_and_target_free_executions_produce_no_rows_but_count_in_num_executions():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a", "b", "c"])
    trees = {e: two_leaf_tree(e) for e in "abc"}
    for tree in trees.values():
        buffer.attach_tree(tree)
    admitted = {"a": admit_greedy(trees["a"]), "b": admit_greedy(trees["b"]), "c": []}
    buffer.mark_ready(0, {"a": 1.0, "b": None, "c": 0.0}, admitted)
    packer = StreamPackingBuffer(buffer, config(batch_groups=1, group_size=3, max_tokens_per_microstep=100))
    assert packer.pull() == 0 and packer.closed
    (step,) = drain(packer)
    assert step.execution_ids == ("a",) and step.num_executions == 3
    # Advantages over the valid members only: a 1.0 and c 0.0 -> mean 0.5.
    assert step.advantage_E.tolist() == [0.5]


def test_a_target_on_a_non_sampled_token_is_rejected():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a"])
    tree = two_leaf_tree("a")
    buffer.attach_tree(tree)
    targets = np.zeros(9, dtype=bool)
    targets[0] = True  # a system token
    buffer.mark_ready(0, {"a": 1.0}, {"a": [AdmittedTrajectory("a", 5, "main", targets)]})
    with pytest.raises(ValueError, match=r"positions \[0\] are not engine-sampled"):
        materialize_group(buffer.group(0))


# -- packing --------------------------------------------------------------------------------------


def test_first_fit_decreasing_exact():
    assert first_fit_decreasing([3, 9, 5, 5, 2], 10) == [[1], [2, 3], [0, 4]]
    with pytest.raises(ValueError, match="more than the capacity"):
        first_fit_decreasing([11], 10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), max_size=40), st.integers(30, 80))
def test_first_fit_decreasing_keeps_every_item_once_within_capacity(lengths, capacity):
    bins = first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert all(b for b in bins)


def test_micro_steps_respect_the_budget_and_hold_every_row_once():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0})
    add_ready_group(buffer, 1, 0, {"c": 0.0, "d": 2.0}, extra=3)
    packer = StreamPackingBuffer(buffer, config(keep_executions_together=False))
    assert packer.top_up(min_pending=100) == [0, 1]
    steps = drain(packer)
    assert packer.queue.closed_and_drained
    assert all(step.num_tokens <= 20 for step in steps)
    rows = [
        (step.execution_ids[e], int(leaf))
        for step in steps
        for e, leaf in zip(step.row_execution_R, step.row_leaf_R, strict=True)
    ]
    assert sorted(rows) == sorted((e, leaf) for e in "abcd" for leaf in (5, 7))
    assert [step.index for step in steps] == list(range(len(steps)))
    # Rows of 9, 10 (group 0) and 9, 13 (group 1) tokens: first-fit decreasing pairs them into 20-token steps.
    assert [step.row_lengths_R().tolist() for step in steps] == [[10, 10], [9, 9], [13], [13], [9, 9]]
    step = steps[0]
    assert step.positions_U().tolist() == list(range(10)) * 2
    assert all(step.num_executions == 4 for step in steps)


def test_a_row_longer_than_the_budget_is_rejected_at_mark_ready():
    buffer = TrajectoryBuffer()
    StreamPackingBuffer(buffer, config(max_tokens_per_microstep=9))  # binds the buffer to the budget
    assert buffer.max_row_tokens == 9
    message = "its row (the path to leaf 7) has 10 tokens, more than the micro-step budget max_row_tokens=9"
    with pytest.raises(ValueError, match=re.escape(message)):
        add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0})
    assert not buffer.group(0).ready and buffer.ready_groups() == []
    # A trajectory without targets makes no row: its length does not matter.
    buffer.mark_ready(0, {"a": 1.0}, {"a": [AdmittedTrajectory("a", 7, "main", np.zeros(10, dtype=bool))]})
    assert buffer.ready_groups() == [0]


def test_a_bad_ready_group_is_set_aside_and_the_stream_goes_on(caplog):
    buffer = TrajectoryBuffer()  # groups marked ready before the packer (and its budget) existed
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0}, extra=3)  # rows of 9 and 13 tokens
    add_ready_group(buffer, 1, 0, {"c": 1.0, "d": 0.0, "e": 0.5})  # N = 3
    add_ready_group(buffer, 2, 0, {"f": 1.0, "g": 0.0})  # fine
    add_ready_group(buffer, 3, 0, {"h": 1.0, "i": 0.0}, extra={"i": 3})  # one row too long
    add_ready_group(buffer, 4, 0, {"j": 1.0, "k": 0.0})  # fine
    packer = StreamPackingBuffer(buffer, config(max_tokens_per_microstep=12))
    with caplog.at_level("WARNING", logger="gyre.data.packing"):
        assert packer.pull() == 2  # groups 0 and 1 are set aside, not retried forever
    assert [g for g, _ in packer.rejected_groups()] == [0, 1]
    reasons = [reason for _, reason in packer.rejected_groups()]
    assert "has 13 tokens, more than packing.max_tokens_per_microstep=12" in reasons[0]
    assert "N=3 executions, the batch expects packing.group_size=2" in reasons[1]
    assert "group 0 set aside" in caplog.text and "group 1 set aside" in caplog.text
    # Chosen by id (the scheduler's claim_group): set aside too, and the error is raised.
    with pytest.raises(ValueError, match=r"group 3 was set aside .*has 13 tokens"):
        packer.pull(3)
    assert buffer.ready_groups() == [4] and packer.pull() == 4 and packer.closed
    assert packer.groups == (2, 4) and [g for g, _ in packer.rejected_groups()] == [0, 1, 3]
    assert {e for step in drain(packer) for e in step.execution_ids} == set("fgjk")


def test_keep_executions_together_puts_an_execution_in_one_micro_step():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0})
    packer = StreamPackingBuffer(buffer, config(batch_groups=1))  # the default: keep_executions_together
    packer.pull()
    steps = drain(packer)
    assert [step.execution_ids for step in steps] == [("a",), ("b",)]
    assert not any(step.has_split for step in steps)
    assert [step.batch_execution_E.tolist() for step in steps] == [[0], [1]]


def test_an_execution_larger_than_the_budget_is_split_over_consecutive_flagged_micro_steps():
    # a and b have rows of 9 and 10 tokens (19); c and d 9 and 14 (23): over the budget of 18.
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0})
    add_ready_group(buffer, 1, 0, {"c": 1.0, "d": 0.0}, extra=4)
    packer = StreamPackingBuffer(buffer, config(max_tokens_per_microstep=23, min_fill=0.9))
    packer.pull()  # whole executions of 19 tokens: held back below 0.9 * 23
    assert packer.queue.pending == 0 and packer.pending_rows == 4
    packer.pull()  # c and d (23) fit whole; then the B-th group: everything goes
    steps = drain(packer)
    assert [step.execution_ids for step in steps] == [("c",), ("d",), ("a",), ("b",)]
    assert not any(step.has_split for step in steps)

    tight = StreamPackingBuffer(TrajectoryBuffer(), config(max_tokens_per_microstep=18))
    add_ready_group(tight.trajectories, 0, 0, {"a": 1.0, "b": 0.0})
    add_ready_group(tight.trajectories, 1, 0, {"c": 1.0, "d": 0.0}, extra={"d": 4})  # d: 9 + 14 tokens
    tight.pull()
    steps = drain(tight)  # a and b split in the pull that brought them, each over consecutive micro-steps
    assert [step.execution_ids for step in steps] == [("a",), ("a",), ("b",), ("b",)]
    assert all(step.split_E.tolist() == [True] for step in steps)
    assert [step.num_targets_E.tolist() for step in steps] == [[5], [5], [5], [5]]
    assert [step.num_targets for step in steps] == [2, 3, 2, 3]
    tight.pull()  # d is split; c (19 tokens) is over the budget too
    steps = drain(tight)
    assert [step.execution_ids for step in steps] == [("c",), ("c",), ("d",), ("d",)]
    assert all(step.has_split for step in steps)
    with pytest.raises(ValueError, match="carries part of split executions \\['c'\\]"):
        steps[0].loss_inputs()


def test_a_whole_execution_fills_the_room_of_a_split_one():
    # b (9 + 16 = 25 tokens) is split over two micro-steps of 20; a (9 + 10) does not fit beside its rows,
    # but c (a single 9-token row: its other leaf has no targets) does.
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a", "b", "c"])
    trees = {"a": two_leaf_tree("a"), "b": two_leaf_tree("b", 6), "c": two_leaf_tree("c")}
    for tree in trees.values():
        buffer.attach_tree(tree)
    admitted = {e: admit_greedy(tree) for e, tree in trees.items()}
    admitted["c"] = admitted["c"][:1]
    buffer.mark_ready(0, {"a": 1.0, "b": 0.0, "c": 0.5}, admitted)
    packer = StreamPackingBuffer(buffer, config(batch_groups=1, group_size=3))
    packer.pull()
    steps = drain(packer)
    assert [step.execution_ids for step in steps] == [("b",), ("b", "c"), ("a",)]
    assert [step.split_E.tolist() for step in steps] == [[True], [True, False], [False]]
    assert [step.batch_execution_E.tolist() for step in steps] == [[1], [1, 2], [0]]


def test_hold_back_emits_only_full_micro_steps_until_the_batch_completes():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0}, extra={"b": 8})  # a: 19 tokens, b: 9 + 18 = 27
    packer = StreamPackingBuffer(buffer, config(max_tokens_per_microstep=30, min_fill=0.9))
    packer.pull()  # b (27 >= 27) is emitted, a (19) waits for the next group: whole
    assert packer.queue.pending == 1 and packer.pending_rows == 2
    assert packer.flush() == 1 and packer.pending_rows == 0
    add_ready_group(buffer, 1, 0, {"c": 0.0, "d": 2.0})
    packer.pull()  # the B-th group: everything is emitted and the stream closes
    assert packer.closed and packer.pending_rows == 0
    assert sum(step.num_rows for step in drain(packer)) == 8


def test_free_rows_never_hold_back_part_of_an_execution():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0})
    packer = StreamPackingBuffer(
        buffer, config(max_tokens_per_microstep=30, min_fill=0.9, keep_executions_together=False)
    )
    # Rows 10, 10, 9, 9: a micro-step of 29 tokens (a's two rows, b's first) is full; b's second row alone
    # (9) is not, but b is emitted in this pull, so it goes too.
    packer.pull()
    assert packer.pending_rows == 0
    steps = drain(packer)
    assert [step.execution_ids for step in steps] == [("a", "b"), ("b",)]
    assert [step.split_E.tolist() for step in steps] == [[False, True], [True]]


# -- batches and selection ---------------------------------------------------------------------------


def test_oldest_version_first_and_the_stream_closes_after_b_groups():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 2, {"a": 1.0, "b": 0.0})
    add_ready_group(buffer, 1, 1, {"c": 1.0, "d": 0.0})
    add_ready_group(buffer, 2, 1, {"e": 1.0, "f": 0.0})
    packer = StreamPackingBuffer(buffer, config())
    assert packer.pull() == 1 and not packer.closed
    assert packer.pull() == 2 and packer.closed
    assert packer.pull() is None  # the batch is full: nothing more joins this stream
    with pytest.raises(ValueError, match="closed"):
        packer.pull(0)
    assert {e for step in drain(packer) for e in step.execution_ids} == set("cdef")
    queue = packer.next_batch()
    assert packer.batch == 1 and queue is packer.queue and not queue.closed
    assert packer.pull() == 0 and packer.pull() is None and not packer.closed
    assert all(step.batch == 1 for step in drain(packer))
    with pytest.raises(ValueError, match="still open"):
        packer.next_batch()


def test_pull_takes_the_group_the_scheduler_chose():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0})
    add_ready_group(buffer, 1, 0, {"c": 1.0, "d": 0.0})
    packer = StreamPackingBuffer(buffer, config())
    assert packer.pull(1) == 1
    with pytest.raises(ValueError, match="already handed out"):
        packer.pull(1)
    assert packer.pull() == 0 and packer.closed


def test_a_group_of_another_size_is_set_aside():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0, "c": 0.5})
    packer = StreamPackingBuffer(buffer, config())
    assert packer.pull() is None and buffer.ready_groups() == []
    ((group_id, reason),) = packer.rejected_groups()
    assert group_id == 0 and "N=3 executions, the batch expects packing.group_size=2" in reason
    assert packer.pull() is None  # the stream is not blocked: nothing else is ready
    add_ready_group(buffer, 1, 0, {"d": 1.0, "e": 0.0})
    assert packer.pull() == 1


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match=re.escape("packing.max_tokens_per_microstep=0")):
        config(max_tokens_per_microstep=0)
    with pytest.raises(ValueError, match=re.escape("packing.min_fill=1.5")):
        config(min_fill=1.5)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("batch_groups", 2.5, "packing.batch_groups=2.5 is not allowed: expected an integer >= 1 (B)"),
        ("batch_groups", True, "packing.batch_groups=True is not allowed"),
        ("batch_groups", 0, "packing.batch_groups=0 is not allowed"),
        ("group_size", 2.0, "packing.group_size=2.0 is not allowed: expected an integer >= 1 (N)"),
        ("group_size", "2", "packing.group_size='2' is not allowed"),
        ("max_tokens_per_microstep", 20.5, "packing.max_tokens_per_microstep=20.5 is not allowed"),
        ("max_tokens_per_microstep", float("inf"), "packing.max_tokens_per_microstep=inf is not allowed"),
        ("keep_executions_together", 1, "packing.keep_executions_together=1 is not allowed: expected a bool"),
        ("min_fill", "0.5", "packing.min_fill='0.5' is not allowed"),
        ("std_eps", None, "packing.std_eps=None is not allowed"),
    ],
)
def test_config_rejects_non_integers_and_wrong_types(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config(**{field: value})


def test_top_up_flushes_held_back_rows_when_no_group_is_ready():
    buffer = TrajectoryBuffer()
    add_ready_group(buffer, 0, 0, {"a": 1.0, "b": 0.0})
    packer = StreamPackingBuffer(buffer, config(max_tokens_per_microstep=30, min_fill=0.9))
    assert packer.top_up(min_pending=2) == [0]  # one full step emitted, then no group: the 9-token row goes too
    assert packer.queue.pending == 2 and packer.pending_rows == 0 and not packer.closed
