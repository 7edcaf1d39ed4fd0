"""Admission of trajectories by role priority (Eq. 4 and the procedure after it).

Role: turn one execution's trajectory tree into at most `j_max` admitted trajectories whose target
sets are disjoint, for the stream packing buffer (`gyre/data`) and the loss (Eq. 5-6).

Procedure (paper: "Trajectory sampling: bounded paths by role priority"): trainable tokens are
the SAMPLED tokens with recorded behavior log-probs (`TrajectoryTree.path_tokens(leaf).target_mask`).
Each draw takes the highest-priority class (Eq. 4: main > main-summary > sub-agent >
sub-agent-summary) that still has a leaf with unmasked trainable tokens, and picks one of its
leaves with probability proportional to that leaf's unmasked trainable token count. The drawn
trajectory's targets freeze to exactly the trainable tokens still unmasked on its path; then the
whole root-to-leaf path is masked, so a shared prefix is trained once and the reduced counts
reweight the next draw. Draws repeat until no unmasked trainable token remains or `j_max`
trajectories are admitted.

Cost: the work is on node ids, not tokens. A node is trainable all or nothing (a SAMPLED node
with a recorded call), so a leaf's unmasked count is `above[leaf] - above[covered[leaf]]`, where
`above[n]` counts the trainable tokens from the root through `n` and `covered[leaf]` is the
deepest masked node on the leaf's path: masked nodes always form a root-closed subtree (whole
paths are masked), so a path is masked exactly down to that node. One pass over the nodes builds
`above` and a depth-first numbering; each draw masks the newly covered chain and updates the
leaves below it with two binary searches. Only the drawn leaves' `targets` arrays are built.

Determinism: for one tree (same node ids) and one seed the result is identical; the leaf is
picked by one integer draw `rng.integers(total)` over the candidates in depth-first order.

Seeding: `admit` has no default seed; a fixed seed for every execution would give every execution
the same random stream. The controller seeds each execution's admission with
`execution_seed(run_seed, execution)`, a blake2b digest of the run's seed and the execution id:
distinct per execution, and the same in every process and Python run (unlike `hash()`), so an
admission can be replayed from the run seed and the execution id alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from gyre.traj.roles import PRIORITY, RoleClassifier, classify_leaves
from gyre.traj.tree import ROOT, TrajectoryTree

DEFAULT_J_MAX = 5
_SEED_PERSON = b"gyre.admission"  # blake2b personalization: these digests differ from any other use


def execution_seed(run_seed: int, execution: str) -> int:
    """The admission seed of `execution` in a run seeded `run_seed`: `admit(tree, classify, rng=seed)`.

    A 64-bit blake2b digest of the decimal `run_seed` and the UTF-8 execution id: different
    executions get independent streams, and the value is stable across processes, machines and
    Python runs (it never uses `hash()`, which is salted per process). TypeError for a non-integer
    `run_seed` (bools included) or a non-string `execution`, ValueError for an empty `execution`.
    """
    if isinstance(run_seed, bool) or not isinstance(run_seed, (int, np.integer)):
        raise TypeError(f"run_seed must be an integer; got {type(run_seed).__name__}")
    if not isinstance(execution, str):
        raise TypeError(f"execution must be a string id; got {type(execution).__name__}")
    if not execution:
        raise ValueError("execution must be a non-empty id")
    digest = hashlib.blake2b(str(int(run_seed)).encode("ascii"), digest_size=8, person=_SEED_PERSON)
    digest.update(b"\x00")  # the decimal seed never contains NUL, so (seed, execution) pairs never collide
    digest.update(execution.encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest(), "big")


@dataclass(frozen=True, eq=False)
class AdmittedTrajectory:
    """One admitted trajectory: the root-to-leaf path of `leaf` in `execution`'s tree.

    `targets` is a boolean mask over the tokens of `TrajectoryTree.path_tokens(leaf).ids`, frozen to
    the engine-sampled tokens that were still unmasked when this trajectory was drawn; the targets of
    one execution's trajectories are disjoint. `role` is the leaf's class ("main", "main-summary",
    "sub-agent", "sub-agent-summary").
    """

    execution: str
    leaf: int
    role: str
    targets: np.ndarray  # bool, one entry per path token

    @property
    def num_targets(self) -> int:
        return int(self.targets.sum())


def admit(
    tree: TrajectoryTree,
    classify: RoleClassifier,
    j_max: int = DEFAULT_J_MAX,
    *,
    rng: np.random.Generator | int,
) -> list[AdmittedTrajectory]:
    """Admit at most `j_max` trajectories of `tree` in draw order (see the module docstring).

    `classify` assigns each leaf its role (`gyre.traj.roles.classifier_for(harness)`); `rng` is a
    numpy Generator or an integer seed and is required: the controller passes
    `execution_seed(run_seed, tree.execution)` so that executions draw independently (a shared
    constant seed would correlate every execution's draws). ValueError for `j_max` < 1, TypeError
    for a bad `rng`.
    """
    if isinstance(j_max, bool) or not isinstance(j_max, (int, np.integer)) or j_max < 1:
        raise ValueError(f"j_max must be a positive integer; got {j_max!r}")
    generator = _generator(rng)
    roles = classify_leaves(tree, classify)
    if not roles:
        return []
    nodes = tree.nodes
    num_nodes = len(nodes)
    parent = np.fromiter((node.parent for node in nodes), np.int64, num_nodes)
    # Trainable tokens per node: all of a recorded SAMPLED node's tokens, or none (tree.path_tokens).
    trainable = np.fromiter((node.num_tokens if node.calls else 0 for node in nodes), np.int64, num_nodes)
    above = trainable.copy()  # trainable tokens from the root through the node
    size = np.ones(num_nodes, np.int64)  # nodes in the subtree
    for node in range(num_nodes - 1, 0, -1):  # a parent is always created before its children
        size[parent[node]] += size[node]
    first = np.zeros(num_nodes, np.int64)  # depth-first number: the subtree of n is [first[n], first[n] + size[n])
    for node in nodes:
        above[node.id] += above[node.parent] if node.id != ROOT else 0
        slot = first[node.id] + 1
        for child in node.children.values():
            first[child] = slot
            slot += size[child]
    end = first + size
    # Leaves in depth-first order: the leaves below any node form one contiguous slice.
    leaf_ids = np.array(sorted(roles, key=lambda leaf: first[leaf]), np.int64)
    leaf_first = first[leaf_ids]
    leaf_rank = np.array([roles[int(leaf)].rank for leaf in leaf_ids], np.int64)
    covered = np.full(len(leaf_ids), ROOT, np.int64)  # deepest masked node on each leaf's path
    masked = np.zeros(num_nodes, bool)
    masked[ROOT] = True
    admitted: list[AdmittedTrajectory] = []
    while len(admitted) < j_max:
        unmasked = above[leaf_ids] - above[covered]
        pick = _draw(unmasked, leaf_rank, generator)
        if pick is None:
            break  # no unmasked trainable token remains
        leaf = int(leaf_ids[pick])
        chain = []  # the newly masked nodes, top-down: exactly the unmasked part of the leaf's path
        node = leaf
        while not masked[node]:
            masked[node] = True
            chain.append(node)
            node = int(parent[node])
        chain.reverse()
        _update_covered(covered, leaf_first, np.array(chain, np.int64), first, end)
        targets = _targets(tree, leaf, [n for n in chain if trainable[n]])
        admitted.append(AdmittedTrajectory(tree.execution, leaf, roles[leaf].value, targets))
    return admitted


def _generator(rng: np.random.Generator | int) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy Generator or an integer seed; got {type(rng).__name__}")


def _draw(unmasked: np.ndarray, rank: np.ndarray, generator: np.random.Generator) -> int | None:
    """Index of the drawn leaf: highest-priority class with unmasked tokens, then P(leaf) = count / total."""
    for class_rank in range(len(PRIORITY)):  # Eq. 4
        candidates = np.flatnonzero((rank == class_rank) & (unmasked > 0))
        if candidates.size:
            cumulative = np.cumsum(unmasked[candidates])
            draw = generator.integers(int(cumulative[-1]))  # uniform token among the class's unmasked ones
            return int(candidates[np.searchsorted(cumulative, draw, side="right")])
    return None


def _update_covered(
    covered: np.ndarray, leaf_first: np.ndarray, chain: np.ndarray, first: np.ndarray, end: np.ndarray
) -> None:
    """Set `covered` of the leaves below the newly masked `chain` (top-down) to their deepest chain node.

    The chain is a path, so its subtree intervals are nested: a leaf below the top lies in the
    subtrees of a top-down prefix of the chain, whose length is the number of chain nodes that
    start at or before the leaf and end after it.
    """
    lo, hi = np.searchsorted(leaf_first, [first[chain[0]], end[chain[0]]])
    below = leaf_first[lo:hi]
    starts_before = np.searchsorted(first[chain], below, side="right")
    ends_after = np.searchsorted(-end[chain], -below, side="left")  # -end is non-decreasing down the chain
    covered[lo:hi] = chain[np.minimum(starts_before, ends_after) - 1]


def _targets(tree: TrajectoryTree, leaf: int, frozen: list[int]) -> np.ndarray:
    """Boolean mask over `path_tokens(leaf)`: True on the tokens of the `frozen` nodes."""
    targets = np.zeros(tree.nodes[leaf].prefix_tokens, bool)
    for node_id in frozen:
        node = tree.nodes[node_id]
        targets[node.prefix_tokens - node.num_tokens : node.prefix_tokens] = True
    return targets
