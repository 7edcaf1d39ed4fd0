"""Routing replay's data from the trees to the micro-steps: rows take their path's routing, micro-steps concatenate it,
and every encoding a micro-step travels in carries it.

Convention (as in test_data_packing.py): system 1..9, user 10..19, tool results 30..39, our outputs 20..29 and
40..49. Routing is 2 layers x top-2; position p of execution e's sequence routes to `[[p, 100 + p], [200 + p, 300 +
p]]` plus 1000 * (the execution's number), so a row's routing reads off its positions and execution.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch.distributed as dist

from gyre.config import PackingConfig
from gyre.data import MicroStep, StreamPackingBuffer, TokenRow, TrajectoryBuffer, build_microstep, materialize_group
from gyre.distributed.claims import StepBoard, StepClaimer, decode_unit, encode_unit
from gyre.trainer.routing import step_routes
from gyre.traj import CallMeta, CallRouting, Provenance, Response, Segment, TrajectoryTree
from gyre.traj.admission import AdmittedTrajectory

SYS, USR, TOOL = Provenance.SYSTEM, Provenance.USER, Provenance.TOOL
UNROUTED = [[-1, -1], [-1, -1]]


def experts(p: int, shift: int) -> list[list[int]]:
    return [[p + shift, 100 + p + shift], [200 + p + shift, 300 + p + shift]]


def routes(start: int, end: int, shift: int) -> CallRouting:
    return CallRouting(
        start, np.array([experts(p, shift) for p in range(start, end)], dtype=np.int64).reshape(-1, 2, 2)
    )


def out(*ids: int) -> Response:
    return Response.build(list(ids), [-i / 100 for i in ids], "stop")


def routed_tree(execution: str, shift: int) -> TrajectoryTree:
    """[1 2 3 | 10 11 | 20 21], then leaf 5: [30 | 40] and leaf 7: [31 | 41 42], each call routed from the first
    position no earlier call routed."""
    tree = TrajectoryTree(execution, 100)
    calls = [
        ([Segment(SYS, [1, 2, 3]), Segment(USR, [10, 11])], out(20, 21), None),
        ([Segment(TOOL, [30])], out(40), 3),
        ([Segment(TOOL, [31])], out(41, 42), 3),
    ]
    for index, (segments, response, parent) in enumerate(calls):
        start = tree.routed_prefix_len(segments, parent)
        context = (0 if parent is None else tree.nodes[parent].prefix_tokens) + sum(len(s) for s in segments)
        routing = routes(start, context + len(response.ids) - 1, shift)
        tree.insert(segments, response, CallMeta(execution, f"r{index}"), parent, routing=routing)
    return tree


def plain_tree(execution: str) -> TrajectoryTree:
    tree = TrajectoryTree(execution, 100)
    tree.insert([Segment(SYS, [1, 2, 3]), Segment(USR, [10, 11])], out(20, 21), CallMeta(execution, "r0"))
    tree.insert([Segment(TOOL, [30])], out(40), CallMeta(execution, "r1"), parent=3)
    return tree


def admit_all(tree: TrajectoryTree) -> list[AdmittedTrajectory]:
    covered: set[int] = set()
    admitted = []
    for leaf in tree.leaves():
        path = tree.path_tokens(leaf)
        fresh = np.concatenate([np.full(tree.nodes[n].num_tokens, n not in covered) for n in tree.path(leaf)])
        covered.update(tree.path(leaf))
        admitted.append(AdmittedTrajectory(tree.execution, leaf, "main", path.target_mask & fresh))
    return admitted


def ready_buffer(trees: dict[str, TrajectoryTree]) -> TrajectoryBuffer:
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, list(trees))
    for tree in trees.values():
        buffer.attach_tree(tree)
    rewards = {e: float(i) for i, e in enumerate(trees)}
    buffer.mark_ready(0, rewards, {e: admit_all(tree) for e, tree in trees.items()})
    return buffer


def test_materialized_rows_carry_their_paths_routing():
    trees = {"a": routed_tree("a", 1000), "b": routed_tree("b", 2000)}
    rows = materialize_group(ready_buffer(trees).group(0))
    assert [(r.execution, r.leaf) for r in rows] == [("a", 5), ("a", 7), ("b", 5), ("b", 7)]
    for row in rows:
        np.testing.assert_array_equal(row.routed_experts_TLK, trees[row.execution].path_routing(row.leaf))
    shift = 1000
    want = [experts(p, shift) for p in range(9)] + [UNROUTED]  # leaf 7: 1 2 3 10 11 20 21 31 41 | 42 never fed
    assert rows[1].routed_experts_TLK.tolist() == want and rows[1].routed_experts_TLK.dtype == np.int16


def test_rows_of_a_tree_without_routing_have_none():
    rows = materialize_group(ready_buffer({"a": plain_tree("a")}).group(0))
    assert [row.routed_experts_TLK for row in rows] == [None]


def row(execution: str, length: int, routing: np.ndarray | None) -> TokenRow:
    targets = np.array([False] + [True] * (length - 1))
    return TokenRow(
        group_id=0,
        execution=execution,
        leaf=length,
        role="main",
        ids=np.arange(length, dtype=np.int64),
        targets=targets,
        behavior_logprobs=np.where(targets, -0.5, 0.0),
        advantage=0.5,
        execution_num_targets=int(targets.sum()),
        batch_execution=0,
        routed_experts_TLK=routing,
    )


def test_a_micro_step_concatenates_its_rows_routing_and_fills_a_row_without_with_minus_one():
    first = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)
    third = np.full((1, 2, 2), 7, dtype=np.int16)
    step = build_microstep(0, 0, [row("a", 3, first), row("b", 2, None), row("c", 1, third)], num_executions=3)
    assert step.routed_experts_ULK.shape == (6, 2, 2) and step.routed_experts_ULK.dtype == np.int16
    assert step.routed_experts_ULK.tolist() == [*first.tolist(), UNROUTED, UNROUTED, *third.tolist()]
    assert build_microstep(0, 0, [row("a", 3, None)], num_executions=1).routed_experts_ULK is None


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        (np.zeros((2, 2, 2), np.int16), r"leaf 3\) has routing of shape \(2, 2, 2\); expected \[3 tokens, 2 layers"),
        (np.zeros((3, 3, 2), np.int16), r"expected \[3 tokens, 2 layers, top-2\] \(as the row of execution 'a'"),
    ],
)
def test_a_micro_step_refuses_routing_that_does_not_fit_its_row(routing, message):
    good = np.zeros((2, 2, 2), np.int16)
    with pytest.raises(ValueError, match=message):
        build_microstep(0, 0, [row("a", 2, good), row("b", 3, routing)], num_executions=2)


def packed_steps(trees: dict[str, TrajectoryTree], budget: int) -> list[MicroStep]:
    buffer = ready_buffer(trees)
    config = PackingConfig(batch_groups=1, group_size=len(trees), max_tokens_per_microstep=budget, min_fill=0.0)
    packer = StreamPackingBuffer(buffer, config)
    packer.pull()
    steps = []
    while (step := packer.queue.claim(0)) is not None:
        steps.append(step)
    return steps


def test_packed_micro_steps_align_routing_with_their_tokens():
    trees = {"a": routed_tree("a", 1000), "b": routed_tree("b", 2000), "c": plain_tree("c")}
    steps = packed_steps(trees, budget=12)  # a and b split over micro-steps (19 tokens each), c whole
    assert len(steps) > 2
    routed = [step for step in steps if step.routed_experts_ULK is not None]
    assert [step.execution_ids for step in steps if step.routed_experts_ULK is None] == [("c",)]  # c's alone
    for step in routed:
        assert step.routed_experts_ULK.shape == (step.num_tokens, 2, 2)
        assert step_routes(step, None) is step.routed_experts_ULK  # what a trainer under routing replay reads
        for r, (start, end) in enumerate(zip(step.row_offsets_R1[:-1], step.row_offsets_R1[1:], strict=True)):
            tree = trees[step.execution_ids[step.row_execution_R[r]]]
            want = tree.path_routing(int(step.row_leaf_R[r]))
            got = step.routed_experts_ULK[start:end]
            if want is None:
                assert (got == -1).all()
            else:
                np.testing.assert_array_equal(got, want)


def assert_same_steps(steps, back) -> None:
    assert len(back) == len(steps)
    for a, b in zip(steps, back, strict=True):
        assert (a.batch, a.index, a.execution_ids) == (b.batch, b.index, b.execution_ids)
        for name in ("ids_U", "row_offsets_R1", "target_U", "behavior_logp_U", "row_leaf_R", "split_E"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        if a.routed_experts_ULK is None:
            assert b.routed_experts_ULK is None
        else:
            assert b.routed_experts_ULK.dtype == np.int16
            np.testing.assert_array_equal(a.routed_experts_ULK, b.routed_experts_ULK)


def test_a_unit_with_routing_round_trips_through_bytes():
    routed = packed_steps({"a": routed_tree("a", 1000), "b": plain_tree("b")}, budget=40)
    plain = packed_steps({"c": plain_tree("c")}, budget=40)
    assert routed[0].routed_experts_ULK is not None and plain[0].routed_experts_ULK is None
    unit = (*routed, *plain)
    back = decode_unit(encode_unit(unit))
    assert_same_steps(unit, back)
    back[0].routed_experts_ULK[0, 0, 0] = 5  # a copy, writable


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def test_a_unit_over_the_value_limit_travels_in_parts_through_the_store(store):
    steps = packed_steps({"a": routed_tree("a", 1000), "b": routed_tree("b", 2000)}, budget=12)
    unit_bytes = len(encode_unit(steps[:1]))
    board = StepBoard(store, 4, max_cells=1, part_bytes=256)
    claimer = StepClaimer(store, 4, timeout_s=10)
    for step in steps:
        board.put(step)
    board.close()
    units = []
    while (claim := claimer.claim()) is not None:
        units.append(claim[1])
    assert unit_bytes > 256
    assert_same_steps(steps, [s for unit in units for s in unit])
    parts = [f"gyre/step/4/unit/0/{j}" for j in range(-(-len(encode_unit(units[0])) // 256))]
    assert store.check(parts)
    board.clear()
    assert not store.check(parts[:1]) and not store.check(["gyre/step/4/unit/0"])


def test_a_group_whose_routing_has_other_layers_is_set_aside():
    buffer = ready_buffer({"a": routed_tree("a", 1000)})
    other = TrajectoryTree("z", 100)
    other.insert(
        [Segment(SYS, [1, 2])], out(20), CallMeta("z", "r0"), routing=CallRouting(0, np.ones((2, 3, 2), np.int16))
    )
    buffer.add_group(1, 0, ["z"])
    buffer.attach_tree(other)
    buffer.mark_ready(1, {"z": 1.0}, {"z": admit_all(other)})
    config = PackingConfig(batch_groups=2, group_size=1, max_tokens_per_microstep=40, min_fill=0.0)
    packer = StreamPackingBuffer(buffer, config)
    assert packer.pull() == 0 and packer.pull() is None
    ((group, reason),) = packer.rejected_groups()
    assert group == 1 and "has routing of 3 layers x top-2; other rows have 2 layers x top-2" in reason
