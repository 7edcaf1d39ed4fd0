"""Property tests over random request sequences (hypothesis).

Requests use a tiny vocabulary so contexts collide, retries repeat outputs and branches share
prefixes often. A request's context is a fresh one, an earlier request's context plus its echoed
output plus new segments (the harness continuing), or a cut of an earlier context plus new
segments (a retry or a divergent branch).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from traj_strategies import VOCAB, request_sequences

from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree, dump_tree

Seg = tuple[Provenance, tuple[int, ...]]


def build(requests, order) -> TrajectoryTree:
    tree = TrajectoryTree("ex", VOCAB)
    for index in order:
        context, output = requests[index]
        segments = [Segment(provenance, ids) for provenance, ids in context]
        tree.insert(segments, Response.build(output, [-0.5] * len(output), "stop"), CallMeta("ex", f"r{index}"))
    return tree


def leaf_paths(tree: TrajectoryTree) -> set[tuple[Seg, ...]]:
    return {
        tuple((tree.nodes[n].provenance, tuple(tree.nodes[n].ids)) for n in tree.path(leaf)) for leaf in tree.leaves()
    }


@settings(max_examples=200, deadline=None)
@given(request_sequences())
def test_each_shared_prefix_is_stored_once(requests):
    tree = build(requests, range(len(requests)))
    tree.check_invariants()
    prefixes = set()
    for context, output in requests:
        full = (*context, (Provenance.SAMPLED, output))
        prefixes.update(full[:end] for end in range(1, len(full) + 1))
    assert tree.stats().unique_nodes == len(prefixes)
    assert tree.tokens_stored == sum(len(prefix[-1][1]) for prefix in prefixes)


@settings(max_examples=200, deadline=None)
@given(request_sequences())
def test_every_call_is_recoverable_exactly(requests):
    tree = build(requests, range(len(requests)))
    assert len(tree.calls) == len(requests)
    for index, (context, output) in enumerate(requests):
        expected_context = [token for _, ids in context for token in ids]
        assert tree.call_tokens(index) == (expected_context, list(output))
        record = tree.calls[index]
        path = [(tree.nodes[n].provenance, tuple(tree.nodes[n].ids)) for n in tree.path(record.context_node)]
        assert path == [(p, tuple(ids)) for p, ids in context]


@settings(max_examples=200, deadline=None)
@given(request_sequences(), st.randoms(use_true_random=False))
def test_insert_order_does_not_change_the_root_to_leaf_paths(requests, rng):
    tree = build(requests, range(len(requests)))
    order = list(range(len(requests)))
    rng.shuffle(order)
    shuffled = build(requests, order)
    assert leaf_paths(shuffled) == leaf_paths(tree)
    a, b = tree.stats(), shuffled.stats()
    assert (a.unique_nodes, a.tokens_stored, a.node_occurrences_expanded, a.leaves, a.target_tokens_stored) == (
        b.unique_nodes,
        b.tokens_stored,
        b.node_occurrences_expanded,
        b.leaves,
        b.target_tokens_stored,
    )


@settings(max_examples=100, deadline=None)
@given(request_sequences())
def test_replaying_only_the_new_segments_from_the_parent_rebuilds_the_tree(requests):
    tree = build(requests, range(len(requests)))
    replay = TrajectoryTree("ex", VOCAB)
    for record in tree.calls:
        replay.insert(record.segments, record.response, record.meta, parent=record.parent)
    assert dump_tree(replay) == dump_tree(tree)
