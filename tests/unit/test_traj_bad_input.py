"""Bad input raises ValueError (or TypeError for wrong types) naming the field, and inserts nothing."""

from __future__ import annotations

import re

import pytest

from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree, dump_tree

SYS, USR, TOOL = Provenance.SYSTEM, Provenance.USER, Provenance.TOOL


def good_tree() -> TrajectoryTree:
    tree = TrajectoryTree("ex", 100)
    tree.insert([Segment(SYS, [1, 2]), Segment(USR, [10])], Response.build([20], [-0.1], "stop"), CallMeta("ex", "r0"))
    return tree


def snapshot(tree: TrajectoryTree) -> tuple[str, int, int, int]:
    return dump_tree(tree), len(tree.calls), len(tree.nodes), tree.tokens_stored


# Each case: (new segments, response ids, logprobs, execution, parent, expected message fragment).
# The new segments always include a fresh TOOL segment, so a partial insert would show.
CASES = {
    "logprob count": ([Segment(TOOL, [30])], [20, 21], [-0.1], "ex", 2, "response.logprobs has 1 values for 2"),
    "negative id": ([Segment(TOOL, [30])], [-1], [-0.1], "ex", 2, "response.ids: token id -1 is negative"),
    "out of vocab": ([Segment(TOOL, [30])], [100], [-0.1], "ex", 2, "token id 100 is out of vocabulary"),
    "context out of vocab": ([Segment(TOOL, [30, 250])], [21], [-0.1], "ex", 2, "segments[0] (tool): token id 250"),
    "context negative": ([Segment(TOOL, [30]), Segment(USR, [-3])], [21], [-0.1], "ex", 2, "segments[1] (user)"),
    "nan logprob": ([Segment(TOOL, [30])], [21], [float("nan")], "ex", 2, "response.logprobs[0] = nan"),
    "inf logprob": ([Segment(TOOL, [30])], [21], [float("-inf")], "ex", 2, "response.logprobs[0] = -inf"),
    "positive logprob": ([Segment(TOOL, [30])], [21, 22], [-0.1, 0.3], "ex", 2, "response.logprobs[1] = 0.3"),
    "empty response": ([Segment(TOOL, [30])], [], [], "ex", 2, "response.ids is empty"),
    "empty segment": ([Segment(TOOL, [30]), Segment(USR, [])], [21], [-0.1], "ex", 2, "segments[1] (user) is empty"),
    "unknown execution": ([Segment(TOOL, [30])], [21], [-0.1], "other", 2, "meta.execution 'other' is unknown"),
    "unknown parent": ([Segment(TOOL, [30])], [21], [-0.1], "ex", 99, "parent node 99 is unknown"),
    "repeated request id": ([Segment(TOOL, [30])], [21], [-0.1], "ex", 2, "meta.request_id 'r0' is already recorded"),
    "negative parent": ([Segment(TOOL, [30])], [21], [-0.1], "ex", -1, "parent node -1 is unknown"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_call_raises_and_leaves_the_tree_unchanged(case):
    segments, ids, logprobs, execution, parent, message = CASES[case]
    tree = good_tree()
    before = snapshot(tree)
    with pytest.raises(ValueError, match=re.escape(message)):
        request = "r0" if case == "repeated request id" else "bad"
        tree.insert(segments, Response.build(ids, logprobs, "stop"), CallMeta(execution, request), parent=parent)
    assert snapshot(tree) == before
    tree.check_invariants()


def test_request_without_context_or_parent_is_rejected():
    tree = good_tree()
    for parent in (None, 0):
        with pytest.raises(ValueError, match="segments is empty and the parent is the root"):
            tree.insert([], Response.build([21], [-0.1], "stop"), CallMeta("ex", "bad"), parent=parent)
    assert len(tree.calls) == 1


def test_ids_beyond_int32_are_a_value_error():
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 2147483647\]"):
        Segment(TOOL, [2**40])
    with pytest.raises(ValueError, match=r"response\.ids"):
        Response.build([2**40], [-0.1], "stop")


def test_wrong_types_are_type_errors():
    tree = good_tree()
    with pytest.raises(TypeError, match="segments\\[0\\] is a list"):
        tree.insert([[30]], Response.build([21], [-0.1], "stop"), CallMeta("ex", "bad"), parent=2)  # type: ignore[list-item]
    assert len(tree.calls) == 1


def test_bad_tree_and_segment_arguments():
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        TrajectoryTree("ex", 0)
    with pytest.raises(ValueError, match="execution must be a non-empty id"):
        TrajectoryTree("", 10)
    with pytest.raises(ValueError, match="segment key must be 16 bytes"):
        Segment(TOOL, [1], key=b"short")
    with pytest.raises(ValueError, match="unknown provenance 'robot'"):
        Provenance.from_label("robot")
