"""The Appendix-C-shaped generator: counts derived from its plan, independently of the tree."""

from __future__ import annotations

import pytest

from gyre.traj.synthetic import PlannedCall, synthetic_execution


def plan_counts(plan: list[PlannedCall]) -> dict[str, object]:
    """Stored nodes, leaves and expanded occurrences from the plan alone (no hashing, no trie).

    A call's context depth is its `after` call's depth plus its new segments (a stream start: just
    its segments; a retry: its original's context depth); its response adds one node unless it
    duplicates an earlier output. Leaves are the non-duplicate calls no later call extends.
    """
    context_depth: dict[int, int] = {}
    for call in plan:
        if call.same_context_as is not None:
            assert not call.new_segments
            context_depth[call.index] = context_depth[call.same_context_as]
        elif call.after is not None:
            context_depth[call.index] = context_depth[call.after] + 1 + len(call.new_segments)
        else:
            context_depth[call.index] = len(call.new_segments)
    extended = {call.after for call in plan if call.after is not None}
    leaves = [call.index for call in plan if call.duplicate_of is None and call.index not in extended]
    return {
        "nodes": sum(len(c.new_segments) - c.shared_segments + (c.duplicate_of is None) for c in plan),
        "leaf_path_nodes": sorted(context_depth[leaf] + 1 for leaf in leaves),
        "leaf_roles": sorted(plan[leaf].role for leaf in leaves),
        "tokens": sum(c.new_tokens + (c.output_tokens if c.duplicate_of is None else 0) for c in plan),
    }


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
def test_stored_nodes_and_expanded_occurrences_match_the_plan(seed):
    execution = synthetic_execution(seed=seed)
    expected = plan_counts(execution.plan)
    tree = execution.build_tree()
    tree.check_invariants()
    stats = tree.stats()
    leaf_paths = sorted(tree.nodes[leaf].depth for leaf in tree.leaves())
    assert stats.requests == len(execution.calls) == 636
    assert stats.unique_nodes == expected["nodes"]
    assert leaf_paths == expected["leaf_path_nodes"]
    assert stats.node_occurrences_expanded == sum(expected["leaf_path_nodes"])
    assert stats.tokens_stored == expected["tokens"]  # each shared prefix stored once


@pytest.mark.parametrize("seed", [0, 5])
def test_shape_follows_the_appendix_c_case(seed):
    plan = synthetic_execution(seed=seed).plan
    counts = plan_counts(plan)
    paths = counts["leaf_path_nodes"]
    assert len(paths) == 10 and min(paths) >= 53 and max(paths) == 293
    # Four stream ends (main, main summary, sub-agent, sub-agent summary) and six abandoned retries.
    roles = counts["leaf_roles"]
    assert roles.count("main-summary") == 1 and roles.count("sub-agent-summary") == 1
    assert sum(c.duplicate_of is not None for c in plan) == 4
    assert sum(c.same_context_as is not None and c.duplicate_of is None for c in plan) == 6
    # Separate roots: main and sub-agent system prompts differ; each compacted stream restarts from its own.
    starts = [c for c in plan if c.after is None and c.same_context_as is None]
    assert sorted((c.stream, c.shared_segments) for c in starts) == [
        ("main-a", 0),
        ("main-b", 1),
        ("sub-a", 0),
        ("sub-b", 1),
    ]


def test_separate_roots_and_compaction_restart_in_the_tree():
    execution = synthetic_execution(seed=0)
    tree = execution.build_tree()
    assert len(tree.nodes[0].children) == 2  # main and sub-agent system prompts
    for root in tree.nodes[0].children.values():
        assert len(tree.nodes[root].children) == 2  # the pre- and post-compaction contexts


def test_generator_is_deterministic_per_seed():
    a, b, c = synthetic_execution(seed=4), synthetic_execution(seed=4), synthetic_execution(seed=5)
    assert [call.response for call in a.calls] == [call.response for call in b.calls]
    assert a.plan == b.plan and a.plan != c.plan


def test_call_count_is_configurable_and_checked():
    assert len(synthetic_execution(seed=0, num_calls=500).calls) == 500
    with pytest.raises(ValueError, match="num_calls=100"):
        synthetic_execution(num_calls=100)
