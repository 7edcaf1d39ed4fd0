"""Shared hypothesis strategies and helpers over trajectory trees with roles (admission, Eq. 6).

`role_trees()` draws random calls: fresh contexts, continuations (echoing an earlier output) and
cuts (retries, branches), each with a random `gyre_role` for the builtin classifier, over a tiny
vocabulary so prefixes and outputs collide often. Context segments come from every non-target
provenance (system, user, tool, harness-injected assistant content, evaluator critiques) and
SAMPLED, which in a context is an unrecorded echo unless a recorded call produced it.

Imported by the test modules as `traj_strategies` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from gyre.traj import PRIORITY, CallMeta, Provenance, Response, Segment, TrajectoryTree

VOCAB = 4
EXECUTION = "ex"
ROLES = [role.value for role in PRIORITY]
# Provenances that condition only: never targets, whatever their ids.
CONDITION_ONLY = (
    Provenance.SYSTEM,
    Provenance.USER,
    Provenance.TOOL,
    Provenance.HARNESS_ASSISTANT,
    Provenance.EVALUATOR,
)
CONTEXT_KINDS = [*CONDITION_ONLY, Provenance.SAMPLED]  # SAMPLED here: an echo, recorded only if some call produced it
ids_strategy = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3).map(tuple)
segment_strategy = st.tuples(st.sampled_from(CONTEXT_KINDS), ids_strategy)


Request = tuple[list[tuple[Provenance, tuple[int, ...]]], tuple[int, ...]]  # (context segments, output ids)


@st.composite
def request_sequences(draw, max_calls: int = 12) -> list[Request]:
    """1..`max_calls` random requests: fresh contexts, continuations echoing an earlier output, cuts."""
    requests: list[Request] = []
    for _ in range(draw(st.integers(1, max_calls))):
        new = draw(st.lists(segment_strategy, min_size=0, max_size=3))
        mode = draw(st.sampled_from(["fresh", "extend", "cut"])) if requests else "fresh"
        if mode == "fresh":
            context = new or [draw(segment_strategy)]
        else:
            earlier_context, earlier_output = requests[draw(st.integers(0, len(requests) - 1))]
            if mode == "extend":
                context = [*earlier_context, (Provenance.SAMPLED, earlier_output), *new]
            else:
                context = earlier_context[: draw(st.integers(1, len(earlier_context)))] + new
        requests.append((context, draw(ids_strategy)))
    return requests


@st.composite
def role_trees(draw, max_calls: int = 12) -> TrajectoryTree:
    """A tree of 1..`max_calls` random calls of execution `EXECUTION` (see the module docstring)."""
    tree = TrajectoryTree(EXECUTION, VOCAB)
    for index, (context, output) in enumerate(draw(request_sequences(max_calls))):
        meta = CallMeta(EXECUTION, f"r{index}", role_signals={"gyre_role": draw(st.sampled_from(ROLES))})
        tree.insert([Segment(p, ids) for p, ids in context], Response.build(output, [-0.5] * len(output), "stop"), meta)
    return tree


def path_positions(tree: TrajectoryTree, leaf: int) -> list[tuple[int, int]]:
    """(node, offset) of every token of `path_tokens(leaf)`, in order."""
    return [(node, offset) for node in tree.path(leaf) for offset in range(tree.nodes[node].num_tokens)]


def covered_targets(tree: TrajectoryTree, admitted) -> set[tuple[int, int]]:
    """The (node, offset) of every frozen target of the admitted trajectories."""
    out: set[tuple[int, int]] = set()
    for trajectory in admitted:
        positions = path_positions(tree, trajectory.leaf)
        out.update(positions[i] for i in np.flatnonzero(trajectory.targets))
    return out


def all_trainable(tree: TrajectoryTree) -> set[tuple[int, int]]:
    """The (node, offset) of every trainable token (recorded SAMPLED) on some leaf's path."""
    out: set[tuple[int, int]] = set()
    for leaf in tree.leaves():
        positions = path_positions(tree, leaf)
        out.update(positions[i] for i in np.flatnonzero(tree.path_tokens(leaf).target_mask))
    return out
