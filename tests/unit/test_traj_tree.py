"""Exact tests of the trajectory tree with readable token ids.

Convention: system prompts are 1..9, user text 10..19, tool results 30..39, our outputs 20..29 and
40..49, harness-written assistant text 50..59, evaluator critiques 60..69. Node ids follow
creation order, so every expected id below can be read off the insert sequence.
"""

from __future__ import annotations

import math
from array import array

import numpy as np
import pytest

import gyre.traj.record as record_module
from gyre.traj import ROOT, CallMeta, Provenance, Response, Segment, TrajectoryTree

SYS, USR, TOOL, OUT, HAR, EVAL = (
    Provenance.SYSTEM,
    Provenance.USER,
    Provenance.TOOL,
    Provenance.SAMPLED,
    Provenance.HARNESS_ASSISTANT,
    Provenance.EVALUATOR,
)


def seg(provenance: Provenance, *ids: int) -> Segment:
    return Segment(provenance, list(ids))


def out(*ids: int, finish: str = "stop") -> Response:
    return Response.build(list(ids), [-0.5] * len(ids), finish)


def meta(request: str) -> CallMeta:
    return CallMeta("ex", request)


def tree_with_first_call() -> TrajectoryTree:
    tree = TrajectoryTree("ex", 100)
    tree.insert([seg(SYS, 1, 2, 3), seg(USR, 10, 11)], out(20, 21), meta("r0"))
    return tree


def test_first_call_creates_one_path_and_a_leaf():
    tree = tree_with_first_call()
    record = tree.calls[0]
    assert (record.parent, record.context_node, record.response_node) == (ROOT, 2, 3)
    assert [tree.nodes[i].provenance for i in tree.path(3)] == [SYS, USR, OUT]
    assert tree.leaves() == [3]
    assert tree.call_tokens(0) == ([1, 2, 3, 10, 11], [20, 21])


def test_extension_reuses_the_echoed_output_and_stores_only_new_content():
    tree = tree_with_first_call()
    context = [seg(SYS, 1, 2, 3), seg(USR, 10, 11), seg(OUT, 20, 21), seg(TOOL, 30)]
    record = tree.insert(context, out(40), meta("r1"))
    assert (record.parent, record.context_node, record.response_node) == (3, 4, 5)
    assert record.segments == (seg(TOOL, 30),)
    assert tree.leaves() == [5]
    assert tree.tokens_stored == 3 + 2 + 2 + 1 + 1
    assert tree.call_tokens(1) == ([1, 2, 3, 10, 11, 20, 21, 30], [40])


def test_parent_api_takes_only_the_new_segments():
    tree = tree_with_first_call()
    record = tree.insert([seg(TOOL, 30)], out(40), meta("r1"), parent=3)
    assert (record.parent, record.context_node, record.response_node) == (3, 4, 5)
    assert tree.call_tokens(1) == ([1, 2, 3, 10, 11, 20, 21, 30], [40])


def test_divergent_context_branches_at_the_last_shared_node():
    tree = tree_with_first_call()
    tree.insert([seg(TOOL, 30)], out(40), meta("r1"), parent=3)
    record = tree.insert([seg(TOOL, 31)], out(41), meta("r2"), parent=3)
    assert (record.parent, record.context_node, record.response_node) == (3, 6, 7)
    assert sorted(tree.nodes[3].children.values()) == [4, 6]
    assert tree.leaves() == [5, 7]
    assert tree.stats().node_occurrences_expanded == 5 + 5


def test_retry_with_different_output_is_a_sibling_and_identical_output_reuses_the_node():
    tree = tree_with_first_call()
    context = [seg(SYS, 1, 2, 3), seg(USR, 10, 11)]
    retry = tree.insert(context, out(22), meta("r1"))
    same = tree.insert(context, Response.build([20, 21], [-0.25, -0.75], "stop"), meta("r2"))
    assert (retry.context_node, retry.response_node) == (2, 4)
    assert (same.context_node, same.response_node) == (2, 3)
    assert tree.nodes[3].calls == [0, 2]
    assert tree.leaves() == [3, 4]
    assert len(tree.calls) == 3 and len(tree.nodes) == 5
    # Each call keeps its own log-probs; the node's path uses the first call's.
    assert list(tree.calls[2].response.logprobs) == [-0.25, -0.75]
    assert list(tree.path_tokens(3).behavior_logprobs[-2:]) == [-0.5, -0.5]


def test_unmatched_request_attaches_to_the_root():
    tree = tree_with_first_call()
    record = tree.insert([seg(SYS, 4, 5), seg(USR, 12)], out(23), meta("r1"))
    assert (record.parent, record.context_node, record.response_node) == (ROOT, 5, 6)
    assert list(tree.nodes[ROOT].children.values()) == [1, 4]


def test_sub_agent_with_its_own_system_prompt_gets_a_separate_root():
    tree = tree_with_first_call()
    main_next = tree.insert([seg(TOOL, 30)], out(40), meta("main-1"), parent=3)
    sub = tree.insert([seg(SYS, 7, 8), seg(USR, 15)], out(42), meta("sub-0"))
    sub_next = tree.insert([seg(TOOL, 33)], out(43), meta("sub-1"), parent=sub.response_node)
    assert tree.path(main_next.response_node)[0] == 1
    assert tree.path(sub_next.response_node) == [6, 7, 8, 9, 10]
    assert tree.leaves() == [5, 10]


def test_compaction_summary_leaf_and_restart_from_the_system_prompt():
    tree = tree_with_first_call()
    tree.insert([seg(TOOL, 30)], out(40), meta("r1"), parent=3)
    # Summary request: the history + tool result + injected instruction.
    summary = tree.insert([seg(OUT, 40), seg(TOOL, 31), seg(USR, 19)], out(44, 45), meta("sum"), parent=4)
    # Continued context: same system prompt, a user message carrying the summary, a harness-written tail.
    continued = tree.insert([seg(SYS, 1, 2, 3), seg(USR, 18, 44, 45), seg(HAR, 50)], out(46), meta("r3"))
    assert summary.response_node == 8 and tree.path(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert continued.parent == 1 and tree.path(continued.response_node) == [1, 9, 10, 11]
    assert tree.leaves() == [8, 11]
    stats = tree.stats()
    assert (stats.unique_nodes, stats.node_occurrences_expanded, stats.leaves) == (11, 8 + 4, 2)


def test_path_tokens_mask_only_recorded_sampled_tokens():
    tree = tree_with_first_call()
    context = [seg(OUT, 20, 21), seg(EVAL, 60, 61), seg(HAR, 50)]
    record = tree.insert(context, out(47, finish="length"), meta("r1"), parent=2)
    path = tree.path_tokens(record.response_node)
    assert path.ids.tolist() == [1, 2, 3, 10, 11, 20, 21, 60, 61, 50, 47]
    assert path.provenance.tolist() == [0, 0, 0, 1, 1, 4, 4, 5, 5, 3, 4]
    assert path.target_mask.tolist() == [False] * 5 + [True, True] + [False] * 3 + [True]
    assert np.isnan(path.behavior_logprobs[~path.target_mask]).all()
    assert path.behavior_logprobs[path.target_mask].tolist() == [-0.5, -0.5, -0.5]


def test_echoed_output_in_a_new_context_conditions_only_until_recorded_there():
    tree = TrajectoryTree("ex", 100)
    # Our earlier output [20, 21] re-appears after a context it was not sampled in.
    tree.insert([seg(SYS, 1), seg(OUT, 20, 21), seg(TOOL, 30)], out(40), meta("r0"))
    path = tree.path_tokens(4)
    assert path.target_mask.tolist() == [False, False, False, False, True]
    assert tree.behavior_logprobs(2) is None
    # The call that produced it at that position arrives later: the node is reused and becomes a target.
    record = tree.insert([seg(SYS, 1)], out(20, 21), meta("r1"))
    assert record.response_node == 2 and tree.nodes[2].calls == [1]
    assert tree.path_tokens(4).target_mask.tolist() == [False, True, True, False, True]
    assert tree.leaves() == [4]


def test_stats_and_invariants_on_a_small_tree():
    tree = tree_with_first_call()
    tree.insert([seg(TOOL, 30)], out(40), meta("r1"), parent=3)
    tree.insert([seg(TOOL, 31, 32)], out(41), meta("r2"), parent=3)
    tree.check_invariants()
    stats = tree.stats()
    assert stats.as_dict() == {
        "requests": 3,
        "unique_nodes": 7,
        "node_occurrences_expanded": 10,
        "tokens_stored": 12,
        "tokens_expanded": 9 + 10,
        "target_tokens_stored": 4,
        "leaves": 2,
    }
    assert math.isclose(stats.tokens_expanded / stats.tokens_stored, 19 / 12)


def test_ingest_with_parent_hashes_only_the_new_content(monkeypatch):
    """Contract 4 without a clock: a call at a long history hashes exactly its new tokens."""
    tree = TrajectoryTree("ex", 100)
    last = tree.insert([seg(SYS, 1, 2, 3)], out(20), meta("h0")).response_node
    for turn in range(1, 300):
        last = tree.insert(
            [seg(TOOL, 30 + turn % 10)], out(40 + turn % 10), meta(f"h{turn}"), parent=last
        ).response_node
    hashed: list[int] = []
    real_key = record_module.segment_key

    def counting_key(provenance, ids):
        hashed.append(len(ids))
        return real_key(provenance, ids)

    monkeypatch.setattr(record_module, "segment_key", counting_key)
    tree.insert([seg(TOOL, 31, 32, 33)], out(44, 45), meta("new"), parent=last)
    assert hashed == [3, 2]  # the new tool result and the new output, nothing of the 600-node history


def test_segment_and_response_copy_the_callers_arrays():
    tree = TrajectoryTree("ex", 100)
    ids = array("i", [1, 2, 3])
    output, logprobs = array("i", [20, 21]), array("d", [-0.5, -0.25])
    tree.insert([Segment(SYS, ids)], Response.build(output, logprobs, "stop"), meta("r0"))
    raw_ids, raw_logprobs = array("i", [22]), array("d", [-0.5])
    tree.insert([Segment(SYS, ids)], Response(raw_ids, raw_logprobs, "stop"), meta("r1"))  # direct constructor
    ids[0], output[0], logprobs[0], raw_ids[0], raw_logprobs[0] = 9, 29, -9.0, 23, -9.0
    tree.check_invariants()
    assert tree.call_tokens(0) == ([1, 2, 3], [20, 21]) and tree.call_tokens(1) == ([1, 2, 3], [22])
    assert list(tree.calls[0].response.logprobs) == [-0.5, -0.25]
    assert list(tree.calls[1].response.logprobs) == [-0.5]
    assert tree.nodes[1].ids.tolist() == [1, 2, 3]


def test_a_caller_supplied_key_that_collides_is_rejected():
    tree = tree_with_first_call()
    stored = tree.nodes[1]  # SYSTEM [1, 2, 3]
    before = (len(tree.nodes), len(tree.calls), tree.tokens_stored)
    for forged in (Segment(SYS, [1, 2, 4], key=stored.key), Segment(SYS, [1, 2], key=stored.key)):
        with pytest.raises(ValueError, match=r"segments\[0\] \(system\): segment key collides with stored node 1"):
            tree.insert([forged, seg(USR, 10, 11)], out(22), meta("bad"))
        with pytest.raises(ValueError, match="segment key collides"):
            tree.match([forged])
    # Same key under a different provenance is a collision too.
    with pytest.raises(ValueError, match="segment key collides"):
        tree.insert([Segment(USR, [1, 2, 3], key=stored.key)], out(22), meta("bad"))
    assert (len(tree.nodes), len(tree.calls), tree.tokens_stored) == before
    # A correct cached key is fine.
    assert tree.insert([Segment(SYS, [1, 2, 3], key=stored.key)], out(22), meta("ok")).parent == 1
    tree.check_invariants()


def test_close_freezes_the_tree():
    tree = tree_with_first_call()
    assert not tree.closed
    tree.close()
    tree.close()  # idempotent
    assert tree.closed
    with pytest.raises(ValueError, match="execution 'ex' is closed"):
        tree.insert([seg(TOOL, 30)], out(40), meta("r1"), parent=3)
    assert len(tree.calls) == 1
    assert tree.call_tokens(0) == ([1, 2, 3, 10, 11], [20, 21])  # reading still works


@pytest.mark.parametrize("shape", ["new context", "retry at a stored context", "same output again"])
def test_a_failing_before_commit_leaves_the_tree_as_it_was_and_gets_the_record_it_would_have(shape):
    tree = tree_with_first_call()
    segments = {
        "new context": [seg(SYS, 1, 2, 3), seg(USR, 10, 11), seg(OUT, 20, 21), seg(TOOL, 30)],
        "retry at a stored context": [seg(SYS, 1, 2, 3), seg(USR, 10, 11)],
        "same output again": [seg(SYS, 1, 2, 3), seg(USR, 10, 11)],
    }[shape]
    response = out(20, 21) if shape == "same output again" else out(40, 41)
    before = (len(tree.nodes), len(tree.calls), tree.tokens_stored, dict(tree.call_of_request))
    offered = []

    def refuse(record):
        offered.append(record)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        tree.insert(segments, response, meta("r1"), before_commit=refuse)
    assert (len(tree.nodes), len(tree.calls), tree.tokens_stored, dict(tree.call_of_request)) == before
    record = tree.insert(segments, response, meta("r1"), before_commit=offered.append)
    first, second = offered
    assert (first.index, first.parent, first.context_node, first.response_node) == (
        record.index,
        record.parent,
        record.context_node,
        record.response_node,
    )
    assert second is record and tree.calls[-1] is record
