"""Routing replay's data in the trajectory tree and the record file: exact small trees with readable values.

Convention (as in test_traj_tree.py): system 1..9, user 10..19, tool results 30..39, our outputs 20..29 and 40..49.
Routing is 2 layers x top-2, and position p of an execution's full sequence is routed to the experts
`[[p, 100 + p], [200 + p, 300 + p]]` (+ `shift` for a call that disagrees), so an expected array reads off positions.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

import gyre.trainer.routing
from gyre.traj import (
    NO_ROUTE,
    CallMeta,
    CallRouting,
    Provenance,
    RecordWriter,
    Response,
    Segment,
    TrajectoryTree,
    load_tree,
)
from gyre.traj.dump import dump_tree
from gyre.traj.synthetic import synthetic_execution

SYS, USR, TOOL, OUT = Provenance.SYSTEM, Provenance.USER, Provenance.TOOL, Provenance.SAMPLED
UNROUTED = [[-1, -1], [-1, -1]]


def seg(provenance: Provenance, *ids: int) -> Segment:
    return Segment(provenance, list(ids))


def out(*ids: int) -> Response:
    return Response.build(list(ids), [-0.5] * len(ids), "stop")


def meta(request: str) -> CallMeta:
    return CallMeta("ex", request)


def experts(p: int, shift: int = 0) -> list[list[int]]:
    return [[p + shift, 100 + p + shift], [200 + p + shift, 300 + p + shift]]


def routes(start: int, end: int, shift: int = 0) -> CallRouting:
    """The routing of positions [start, end)."""
    return CallRouting(
        start, np.array([experts(p, shift) for p in range(start, end)], dtype=np.int64).reshape(-1, 2, 2)
    )


def expected(*rows: int | None) -> np.ndarray:
    """Path routing: a position routes to `experts(p)`, None is unrouted."""
    return np.array([UNROUTED if p is None else experts(p) for p in rows], dtype=np.int16).reshape(-1, 2, 2)


def first_call(tree: TrajectoryTree | None = None):
    """[1 2 3 | 10 11] -> [20 21]: positions 0..5 routed, 6 (its last output token, never fed) not."""
    tree = tree or TrajectoryTree("ex", 100)
    record = tree.insert([seg(SYS, 1, 2, 3), seg(USR, 10, 11)], out(20, 21), meta("r0"), routing=routes(0, 6))
    return tree, record


# -- CallRouting --------------------------------------------------------------------------------------------------


def test_call_routing_copies_into_a_read_only_int16_array():
    source = np.array([[[1, 2]], [[3, -1]]], dtype=np.int64)
    routing = CallRouting(4, source)
    source[0, 0, 0] = 9
    assert routing.experts.dtype == np.int16 and routing.experts.tolist() == [[[1, 2]], [[3, -1]]]
    assert (routing.start, routing.end, routing.num_tokens, routing.layers_topk) == (4, 6, 2, (1, 2))
    with pytest.raises(ValueError, match="read-only"):
        routing.experts[0, 0, 0] = 5
    assert routing == CallRouting(4, [[[1, 2]], [[3, -1]]]) and routing != CallRouting(3, source)
    assert (
        NO_ROUTE == gyre.trainer.routing.NO_ROUTE == -1
        and CallRouting(0, np.zeros((0, 3, 2), np.int32)).num_tokens == 0
    )


@pytest.mark.parametrize(
    ("start", "experts_", "error", "message"),
    [
        (-1, np.zeros((1, 1, 1)), ValueError, r"routing.start = -1: expected an integer >= 0"),
        (True, np.zeros((1, 1, 1), np.int16), ValueError, r"routing.start = True"),
        (0, np.zeros((2, 2), np.int16), ValueError, r"shape \(2, 2\): expected \[tokens, num_hidden_layers"),
        (0, np.zeros((2, 0, 2), np.int16), ValueError, r"shape \(2, 0, 2\)"),
        (0, np.zeros((1, 1, 1), np.float32), TypeError, r"dtype float32: expected integer expert ids"),
        (0, np.full((1, 1, 1), -2), ValueError, r"holds -2: expert ids must lie in \[0, 32767\], or -1"),
        (0, np.full((1, 1, 1), 32768, np.int32), ValueError, r"holds 32768"),
    ],
)
def test_call_routing_rejects_bad_input(start, experts_, error, message):
    with pytest.raises(error, match=message):
        CallRouting(start, experts_)


# -- the tree -----------------------------------------------------------------------------------------------------


def test_two_calls_extending_each_other_route_every_fed_position_once():
    tree, record = first_call()
    assert record.routing == routes(0, 6) and tree.calls[0].routing is None  # the nodes hold it, once
    np.testing.assert_array_equal(tree.path_routing(3), expected(0, 1, 2, 3, 4, 5, None))
    np.testing.assert_array_equal(tree.path_routing(2), expected(0, 1, 2, 3, 4))
    # What a proxy asks the engine for: the output's last token is the first unrouted position.
    assert tree.routed_prefix_len([seg(SYS, 1, 2, 3), seg(USR, 10, 11), seg(OUT, 20, 21), seg(TOOL, 30)]) == 6
    assert tree.routed_prefix_len([seg(TOOL, 30)], parent=3) == 6
    assert tree.routed_prefix_len(parent=3) == 6
    assert tree.routed_prefix_len([seg(SYS, 1, 2, 3), seg(USR, 10, 11)]) == 5  # a retry: all of it
    assert tree.routed_prefix_len([seg(SYS, 1, 2, 3), seg(USR, 12)]) == 3  # a new user turn: the system prompt
    assert tree.routed_prefix_len([seg(SYS, 4)]) == 0 and tree.routed_prefix_len() == 0
    # The next call relies on the first's routing for positions 0..5 and routes the rest.
    tree.insert([seg(TOOL, 30)], out(40, 41), meta("r1"), parent=3, routing=routes(6, 9))
    np.testing.assert_array_equal(tree.path_routing(5), expected(*range(9), None))
    assert tree.routed_prefix_len(parent=5) == 9
    assert [tree.nodes[n].chain_routed for n in range(6)] == [True, True, True, True, True, False]
    assert (tree.routing_compared_tokens, tree.routing_mismatched_tokens) == (0, 0)
    tree.check_invariants()


def test_a_fork_shares_the_prefix_routing_and_routes_only_its_branch():
    tree, _ = first_call()
    tree.insert([seg(TOOL, 30)], out(40), meta("r1"), parent=3, routing=routes(6, 8))
    start = tree.routed_prefix_len([seg(TOOL, 31, 32)], parent=3)
    assert start == 7  # the first call's output is routed now (the second call fed its last token)
    tree.insert([seg(TOOL, 31, 32)], out(41, 42), meta("r2"), parent=3, routing=routes(start, 10))
    assert tree.leaves() == [5, 7]
    np.testing.assert_array_equal(tree.path_routing(5), expected(0, 1, 2, 3, 4, 5, 6, 7, None))
    np.testing.assert_array_equal(tree.path_routing(7), expected(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, None))
    tree.check_invariants()


def test_a_retry_sibling_routes_only_its_own_output():
    tree, _ = first_call()
    context = [seg(SYS, 1, 2, 3), seg(USR, 10, 11)]
    start = tree.routed_prefix_len(context)
    record = tree.insert(context, out(22, 23, 24), meta("r1"), routing=routes(start, 7, shift=1000))
    assert (start, record.response_node) == (5, 4)
    shifted = [*expected(*range(5)).tolist(), experts(5, 1000), experts(6, 1000), UNROUTED]
    np.testing.assert_array_equal(tree.path_routing(4), np.array(shifted, dtype=np.int16))
    np.testing.assert_array_equal(tree.path_routing(3), expected(0, 1, 2, 3, 4, 5, None))  # untouched
    tree.check_invariants()


def test_the_first_call_that_routed_a_position_wins_and_a_disagreement_is_counted():
    tree, _ = first_call()
    again = routes(0, 6).experts.copy()
    again[2, 1] = [7, 8]  # position 2, layer 1: other experts (counted)
    again[3, 0] = again[3, 0, ::-1]  # position 3, layer 0: the same experts in another order (the same set)
    # An identical output (its node is reused) whose engine was asked for everything from position 0.
    tree.insert([seg(SYS, 1, 2, 3), seg(USR, 10, 11)], out(20, 21), meta("r1"), routing=CallRouting(0, again))
    np.testing.assert_array_equal(tree.path_routing(3), expected(0, 1, 2, 3, 4, 5, None))
    assert (tree.routing_compared_tokens, tree.routing_mismatched_tokens) == (6, 1)
    tree.check_invariants()


def test_a_call_without_routing_leaves_a_gap_the_next_routed_call_fills():
    tree, _ = first_call()
    tree.insert([seg(TOOL, 30)], out(40), meta("r1"), parent=3)  # its engine returned none
    np.testing.assert_array_equal(tree.path_routing(5), expected(0, 1, 2, 3, 4, 5, None, None, None))
    assert tree.routed_prefix_len(parent=5) == 6  # the gap is above `parent`: found by walking up to it
    assert tree.routed_prefix_len([seg(TOOL, 31)], parent=5) == 6
    tree.insert([seg(TOOL, 31)], out(41), meta("r2"), parent=5, routing=routes(6, 10))
    np.testing.assert_array_equal(tree.path_routing(7), expected(*range(10), None))
    assert tree.routed_prefix_len(parent=7) == 10
    tree.check_invariants()


def test_a_node_routed_after_its_descendants_marks_them_routed_from_the_root():
    tree, _ = first_call()
    # A call asked from position 7: it leaves position 6 (the first output's last token) unrouted.
    tree.insert([seg(TOOL, 30, 31)], out(40), meta("r1"), parent=3, routing=routes(7, 9))
    assert tree.routed_prefix_len([seg(TOOL, 30, 31)], parent=3) == 6
    assert not tree.nodes[4].chain_routed and tree.nodes[4].routed_leading == 2
    # A sibling branch routes position 6: node 3 is routed throughout, so node 4 (already full) becomes so too.
    tree.insert([seg(TOOL, 32)], out(41), meta("r2"), parent=3, routing=routes(6, 8))
    assert tree.nodes[3].chain_routed and tree.nodes[4].chain_routed
    assert tree.routed_prefix_len([seg(TOOL, 30, 31), seg(OUT, 40)], parent=3) == 9
    tree.check_invariants()


def test_a_tree_without_routing_has_none():
    tree = TrajectoryTree("ex", 100)
    tree.insert([seg(SYS, 1, 2, 3)], out(20), meta("r0"))
    assert tree.path_routing(2) is None and tree.routing_layers_topk is None
    assert tree.routed_prefix_len([seg(SYS, 1, 2, 3)]) == 0
    with pytest.raises(ValueError, match="parent node 9 is unknown"):
        tree.routed_prefix_len(parent=9)
    tree.check_invariants()


def state(tree: TrajectoryTree):
    routing = [None if (r := tree.path_routing(n)) is None else r.tolist() for n in range(len(tree.nodes))]
    return dump_tree(tree), len(tree.calls), tree.routing_layers_topk, routing, tree.routed_prefix_len(parent=3)


@pytest.mark.parametrize(
    ("routing", "error", "message"),
    [
        (routes(6, 8), ValueError, r"covers positions \[6, 8\) .* expected it to end at 9 = 8 context \+ 2 output"),
        (routes(6, 10), ValueError, r"expected it to end at 9"),
        (
            CallRouting(6, np.zeros((3, 3, 2), np.int16)),
            ValueError,
            r"3 layers x top-2; .* calls have 2 layers x top-2",
        ),
        ("experts", TypeError, r"routing is a str; expected a CallRouting"),
    ],
)
def test_bad_routing_is_refused_and_the_tree_is_unchanged(routing, error, message):
    tree, _ = first_call()
    before = state(tree)
    written = []
    with pytest.raises(error, match=message):
        tree.insert([seg(TOOL, 30)], out(40, 41), meta("r1"), parent=3, routing=routing, before_commit=written.append)
    assert state(tree) == before and written == []
    tree.check_invariants()


def test_a_refused_first_routing_sets_no_shape():
    tree = TrajectoryTree("ex", 100)
    with pytest.raises(ValueError, match="expected it to end at 3"):
        tree.insert([seg(SYS, 1, 2)], out(20, 21), meta("r0"), routing=routes(0, 2))
    assert tree.routing_layers_topk is None and len(tree.nodes) == 1


def position_experts(full: list[int], start: int) -> CallRouting:
    """Experts that depend only on (position, token): the same prefix gets the same routing on every path."""
    rows = [[[p % 32000, full[p] % 32000], [(p + full[p]) % 32000, 7]] for p in range(start, len(full) - 1)]
    return CallRouting(start, np.array(rows, dtype=np.int64).reshape(-1, 2, 2))


def test_a_synthetic_execution_routed_from_each_prefix_routes_every_fed_token_exactly_once():
    execution = synthetic_execution(seed=1)
    tree = TrajectoryTree(execution.execution, execution.vocab_size)
    given = again = 0
    for call in execution.calls:
        start = tree.routed_prefix_len(call.context)
        full = [t for segment in call.context for t in segment.ids] + list(call.response.ids)
        routing = position_experts(full, start)
        given += routing.num_tokens
        record = tree.insert(call.context, call.response, call.meta, routing=routing)
        if tree.nodes[record.response_node].calls[0] != record.index:  # an identical output: routed before
            again += len(call.response.ids) - 1
    tree.check_invariants()
    routed = sum(int(node.routed.sum()) for node in tree.nodes[1:] if node.routed is not None)
    # Only an identical output (which the proxy cannot foresee) is routed twice; the same experts, no mismatch.
    assert again > 0 and given == routed + again
    assert (tree.routing_compared_tokens, tree.routing_mismatched_tokens) == (again, 0)
    for leaf in tree.leaves():  # every token but the leaf's last one was fed by some call
        ids = tree.path_tokens(leaf).ids.tolist()
        want = position_experts(ids, 0).experts
        got = tree.path_routing(leaf)
        np.testing.assert_array_equal(got[:-1], want)
        assert (got[-1] == NO_ROUTE).all()


# -- the record file ----------------------------------------------------------------------------------------------


def write_routed(path) -> TrajectoryTree:
    tree = TrajectoryTree("ex", 100)
    with RecordWriter(path, "ex", 100) as writer:
        writer.append(first_call(tree)[1])
        writer.append(tree.insert([seg(TOOL, 30)], out(40), meta("r1"), parent=3))  # no routing
        writer.append(tree.insert([seg(TOOL, 31, 32)], out(41, 42), meta("r2"), parent=3, routing=routes(6, 10)))
    return tree


def test_routing_round_trips_through_the_record_file(tmp_path):
    path = tmp_path / "ex.jsonl"
    tree = write_routed(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert "routing" not in lines[2]  # a call without routing: the line as before
    field = lines[3]["routing"]
    assert field["start"] == 6 and field["shape"] == [4, 2, 2]
    assert base64.b64decode(field["int16_b64"]) == routes(6, 10).experts.astype("<i2").tobytes()
    loaded = load_tree(path)
    assert dump_tree(loaded) == dump_tree(tree) and loaded.routing_layers_topk == (2, 2)
    for node in range(len(tree.nodes)):
        np.testing.assert_array_equal(loaded.path_routing(node), tree.path_routing(node))
    assert loaded.routed_prefix_len(parent=7) == tree.routed_prefix_len(parent=7) == 10
    loaded.check_invariants()


def edit_routing(path, lineno: int, **changes) -> None:
    lines = path.read_text().splitlines(keepends=True)
    obj = json.loads(lines[lineno - 1])
    obj["routing"].update(changes)
    lines[lineno - 1] = json.dumps(obj) + "\n"
    path.write_text("".join(lines))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shape": [4, 2]}, r"ex.jsonl:4: routing: shape \[4, 2\]; expected \[tokens, layers, top_k\]"),
        ({"shape": [3, 2, 2]}, r"ex.jsonl:4: routing: int16_b64 holds 32 bytes; shape \[3, 2, 2\] needs 24"),
        ({"int16_b64": "not base64!"}, r"ex.jsonl:4: routing: int16_b64 is not base64"),
        ({"start": -6}, r"ex.jsonl:4: routing.start = -6"),
        ({"start": 5}, r"ex.jsonl:4: routing covers positions \[5, 9\)"),
        ({"int16_b64": None}, r"ex.jsonl:4: routing: field 'int16_b64' = None is missing"),
    ],
)
def test_a_bad_routing_field_names_file_and_line(tmp_path, changes, message):
    path = tmp_path / "ex.jsonl"
    write_routed(path)
    edit_routing(path, 4, **changes)
    with pytest.raises(ValueError, match=message):
        load_tree(path)


def test_positions_the_engine_returned_as_all_minus_one_stay_unrouted_until_a_call_routes_them():
    tree = TrajectoryTree("ex", 100)
    blind = routes(0, 6).experts.copy()
    blind[1:3] = NO_ROUTE  # positions 1 and 2: the engine did not know their experts (e.g. a cached prefix)
    tree.insert([seg(SYS, 1, 2, 3), seg(USR, 10, 11)], out(20, 21), meta("r0"), routing=CallRouting(0, blind))
    np.testing.assert_array_equal(tree.path_routing(3), expected(0, None, None, 3, 4, 5, None))
    assert tree.routed_prefix_len([seg(SYS, 1, 2, 3), seg(USR, 10, 11)]) == 1
    tree.insert([seg(SYS, 1, 2, 3), seg(USR, 10, 11)], out(22), meta("r1"), routing=routes(1, 5, shift=1000))
    shifted = [experts(0), experts(1, 1000), experts(2, 1000), experts(3), experts(4)]
    np.testing.assert_array_equal(tree.path_routing(2), np.array(shifted, dtype=np.int16))
    assert (tree.routing_compared_tokens, tree.routing_mismatched_tokens) == (2, 2)  # positions 3 and 4
    assert tree.routed_prefix_len([seg(SYS, 1, 2, 3), seg(USR, 10, 11)]) == 5
    tree.check_invariants()
