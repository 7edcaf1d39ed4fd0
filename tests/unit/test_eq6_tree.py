"""Eq. 6 on a real trajectory tree: which admitted trajectory carries a shared target does not matter.

Paper ("Execution-level objective"): for a fixed admitted target set T_i, choosing a different selected
path to carry a given shared target leaves s_i, the clipping decision and the loss of the execution
unchanged. Here a tree's trajectories are admitted under different draw orders (different seeds), rows are
materialized as admission hands them to packing (`path_tokens(leaf).ids` plus each trajectory's frozen
`targets`), and a fixed "current policy" gives each tree token (node, offset) one log-prob, a leaf of the
autograd graph. `gyre.rl.policy_loss` with the execution's L_i must then give the same loss, s_i, mask m_i
and gradient per (node, offset) whichever trajectory carried which shared target.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close
from traj_strategies import all_trainable, covered_targets, path_positions, role_trees

from gyre.rl import LossConfig, finalize_sequence_ratio, policy_loss, sequence_clip_keep, sequence_log_ratio_sums
from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree, admit, classifier_for
from gyre.traj.admission import execution_seed

CFG = LossConfig()
BUILTIN = classifier_for("builtin")
SYS, USR, TOOL, OUT = Provenance.SYSTEM, Provenance.USER, Provenance.TOOL, Provenance.SAMPLED


def shared_prefix_tree() -> TrajectoryTree:
    """Nodes: 1 SYS[1] 2 USR[10] 3 OUT[20,21,22] 4 TOOL[30] 5 OUT[40] 6 TOOL[31] 7 OUT[41,42].

    Leaves 5 and 7 share the SAMPLED prefix OUT[20,21,22]: whichever is drawn first carries its targets.
    Behavior log-probs differ per token so the importance weights differ.
    """
    tree = TrajectoryTree("ex", 100)
    context = [Segment(SYS, [1]), Segment(USR, [10])]
    calls = [
        (context, [20, 21, 22], [-0.4, -1.1, -2.0]),
        ([*context, Segment(OUT, [20, 21, 22]), Segment(TOOL, [30])], [40], [-0.7]),
        ([*context, Segment(OUT, [20, 21, 22]), Segment(TOOL, [31])], [41, 42], [-0.3, -1.6]),
    ]
    for index, (segments, output, logprobs) in enumerate(calls):
        meta = CallMeta("ex", f"r{index}", role_signals={"gyre_role": "main"})
        tree.insert(segments, Response.build(output, logprobs, "stop"), meta)
    return tree


def current_logp(tree: TrajectoryTree, shift: float, spread: float) -> dict[tuple[int, int], float]:
    """A fixed current policy: one log-prob per tree token (node, offset), behavior + a deterministic delta.

    Tokens without a behavior log-prob (context) get an arbitrary value; they never enter the loss.
    """
    values: dict[tuple[int, int], float] = {}
    for node in tree.nodes[1:]:
        recorded = tree.behavior_logprobs(node.id)
        for offset in range(node.num_tokens):
            delta = shift + spread * math.sin(7.0 * node.id + 3.0 * offset)
            base = -1.0 if recorded is None else recorded[offset]
            values[node.id, offset] = base + delta
    return values


class Assignment:
    """One admission of a tree, materialized into loss inputs and evaluated at a fresh parameter copy."""

    def __init__(self, tree: TrajectoryTree, admitted, logp: dict[tuple[int, int], float]) -> None:
        self.tree, self.admitted = tree, admitted
        self.keys = sorted(logp)
        self.index = {key: i for i, key in enumerate(self.keys)}
        self.theta = torch.tensor([logp[key] for key in self.keys], dtype=torch.float64, requires_grad=True)
        param_rows, behavior_rows = [], []
        for trajectory in admitted:
            tokens = tree.path_tokens(trajectory.leaf)
            positions = path_positions(tree, trajectory.leaf)
            # The row is built from the path's ids; each id is the token stored at (node, offset).
            assert [tree.nodes[n].ids[o] for n, o in positions] == tokens.ids.tolist()
            row_params = torch.tensor([self.index[p] for p in positions], dtype=torch.int64)
            mask = torch.from_numpy(trajectory.targets.copy())
            param_rows.append(row_params[mask])  # logp_RS[target_RS] of this row
            behavior_rows.append(torch.from_numpy(tokens.behavior_logprobs[trajectory.targets].copy()))
        self.params_T = torch.cat(param_rows) if param_rows else torch.zeros(0, dtype=torch.int64)
        self.behavior_T = torch.cat(behavior_rows) if behavior_rows else torch.zeros(0, dtype=torch.float64)
        self.num_targets = sum(t.num_targets for t in admitted)
        self.rows = [len(rows) for rows in param_rows]

    def loss(self, advantage: float, num_executions: int = 3) -> dict[str, torch.Tensor]:
        """Loss, s_i, m_i, L_i and d loss / d logp per (node, offset), over all rows in one call."""
        self.theta.grad = None
        logp_T = self.theta[self.params_T]
        execution_T = torch.zeros(len(logp_T), dtype=torch.int64)
        advantage_E = torch.tensor([advantage], dtype=torch.float64)
        num_targets_E = torch.tensor([self.num_targets])
        loss, metrics = policy_loss(
            logp_T, self.behavior_T, execution_T, advantage_E, num_executions, CFG, num_targets_E=num_targets_E
        )
        loss.backward()
        sum_E, count_E = sequence_log_ratio_sums((logp_T - self.behavior_T).detach(), execution_T, 1)
        s_E = finalize_sequence_ratio(sum_E, count_E)
        return {
            "loss": loss.detach(),
            "s": s_E,
            "m": sequence_clip_keep(s_E, advantage_E, CFG),
            "L": count_E,
            "grad": self.theta.grad.clone(),
            "num_targets": torch.tensor(metrics["num_targets"], dtype=torch.float64),
        }

    def loss_per_trajectory(self, advantage: float, num_executions: int = 3) -> dict[str, torch.Tensor]:
        """The same execution split into one call per admitted trajectory (a micro-step each), with the
        execution's L_i and s_i passed in: Eq. 6's sum over r of (L_r / L_i) * (1 / L_r) * sum over T_r."""
        self.theta.grad = None
        advantage_E = torch.tensor([advantage], dtype=torch.float64)
        num_targets_E = torch.tensor([self.num_targets])
        with torch.no_grad():
            execution_T = torch.zeros(len(self.params_T), dtype=torch.int64)
            sums = sequence_log_ratio_sums(self.theta[self.params_T] - self.behavior_T, execution_T, 1)
            seq_ratio_E = finalize_sequence_ratio(*sums)
        total = torch.zeros((), dtype=torch.float64)
        start = 0
        for length in self.rows:
            params = self.params_T[start : start + length]
            behavior = self.behavior_T[start : start + length]
            start += length
            loss, _ = policy_loss(
                self.theta[params],
                behavior,
                torch.zeros(length, dtype=torch.int64),
                advantage_E,
                num_executions,
                CFG,
                num_targets_E=num_targets_E,
                seq_ratio_E=seq_ratio_E,
            )
            loss.backward()
            total = total + loss.detach()
        grad = self.theta.grad.clone() if self.theta.grad is not None else torch.zeros_like(self.theta)
        return {"loss": total, "grad": grad}


def assert_same(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    for name in first:
        assert_close(first[name], second[name], msg=lambda message, name=name: f"{name}: {message}")


def first_leaves(tree: TrajectoryTree, run_seeds) -> dict[int, int]:
    """{first drawn leaf: a run seed that draws it first} over the given run seeds."""
    out: dict[int, int] = {}
    for run_seed in run_seeds:
        leaf = admit(tree, BUILTIN, rng=execution_seed(run_seed, tree.execution))[0].leaf
        out.setdefault(leaf, run_seed)
    return out


# (advantage, shift, spread, m_i): weights around 1; s_i > 1.005 with A > 0 (clipped); s_i < 0.995 with A < 0
# (clipped); A < 0 with s_i > 1 (kept); A < 0 with weights over the token ratio cap (rho up to e^2.5 > 5); A = 0.
CASES = [
    (1.0, 0.0, 0.002, True),
    (1.3, 0.05, 0.01, False),
    (-0.8, -0.05, 0.01, False),
    (-2.0, 0.4, 0.3, True),
    (-0.7, 1.0, 1.5, True),
    (0.0, 0.1, 0.2, True),
]


@pytest.mark.parametrize(("advantage", "shift", "spread", "keep"), CASES)
def test_the_carrier_of_a_shared_prefix_does_not_change_loss_ratio_mask_or_gradient(advantage, shift, spread, keep):
    tree = shared_prefix_tree()
    seeds = first_leaves(tree, range(200))
    assert sorted(seeds) == [5, 7], "some run seed must draw each leaf first"
    logp = current_logp(tree, shift, spread)
    runs = {}
    for leaf, run_seed in seeds.items():
        admitted = admit(tree, BUILTIN, rng=execution_seed(run_seed, tree.execution))
        assert admitted[0].leaf == leaf and len(admitted) == 2
        shared = [t for t in admitted if t.targets[2:5].all()]  # OUT[20,21,22] is path tokens 2..4 of both leaves
        assert [t.leaf for t in shared] == [leaf], "the first-drawn leaf carries the shared prefix's targets"
        assert covered_targets(tree, admitted) == all_trainable(tree)
        runs[leaf] = Assignment(tree, admitted, logp)
    assert runs[5].rows != runs[7].rows  # the packed rows differ: [3 + 1, 2] vs [3 + 2, 1]
    one_call = {leaf: run.loss(advantage) for leaf, run in runs.items()}
    assert_same(one_call[5], one_call[7])
    assert int(one_call[5]["L"]) == 6 and bool(one_call[5]["m"][0]) is keep
    # The gradient lands exactly on the targets, each with coefficient -m_i * w_u * A_i / (L_i * num_executions)
    # where the token-loss cap does not bind; context tokens get none.
    grad = one_call[5]["grad"]
    target_index = [runs[5].index[p] for p in sorted(all_trainable(tree))]
    others = torch.ones_like(grad, dtype=torch.bool)
    others[target_index] = False
    assert not grad[others].any()
    rho = torch.exp(torch.tensor([logp[p] - tree.behavior_logprobs(p[0])[p[1]] for p in sorted(all_trainable(tree))]))
    expected = -float(one_call[5]["m"][0]) * rho.clamp(max=CFG.token_ratio_cap) * advantage / (6 * 3)
    assert_close(grad[target_index], expected.to(torch.float64))
    if advantage == 0.0 or not bool(one_call[5]["m"][0]):
        assert float(one_call[5]["loss"]) == 0.0
    # Split per trajectory (one micro-step each), with L_i and s_i of the execution: the same loss and gradient.
    for leaf, run in runs.items():
        split = run.loss_per_trajectory(advantage)
        assert_close(split["loss"], one_call[leaf]["loss"])
        assert_close(split["grad"], one_call[leaf]["grad"])


def test_an_execution_with_no_targets_has_zero_loss_and_zero_gradient():
    empty = TrajectoryTree("empty", 100)
    assert admit(empty, BUILTIN, rng=execution_seed(0, "empty")) == []
    tree = shared_prefix_tree()
    run = Assignment(empty, [], current_logp(tree, 0.1, 0.2))  # parameters exist, but no row uses them
    result = run.loss(advantage=1.5)
    assert float(result["loss"]) == 0.0 and int(result["L"]) == 0 and float(result["s"]) == 1.0
    assert not result["grad"].any()
    # Next to a real execution in one call, it changes neither the loss nor the gradient.
    admitted = admit(tree, BUILTIN, rng=0)
    alone = Assignment(tree, admitted, current_logp(tree, 0.0, 0.002))
    reference = alone.loss(advantage=1.0, num_executions=2)
    alone.theta.grad = None
    logp_T = alone.theta[alone.params_T]
    loss, _ = policy_loss(
        logp_T,
        alone.behavior_T,
        torch.zeros(len(logp_T), dtype=torch.int64),
        torch.tensor([1.0, -3.0], dtype=torch.float64),  # execution 1: no targets, nonzero advantage
        2,
        CFG,
        num_targets_E=torch.tensor([alone.num_targets, 0]),
    )
    loss.backward()
    assert_close(loss.detach(), reference["loss"])
    assert_close(alone.theta.grad, reference["grad"])


@settings(max_examples=100, deadline=None)
@given(
    role_trees(max_calls=8),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.sampled_from([-1.5, -0.5, 0.0, 0.5, 2.0]),
    st.floats(-0.5, 0.5),
    st.floats(0.0, 1.0),
)
def test_random_trees_any_draw_order_gives_the_same_execution_loss(tree, seed_a, seed_b, advantage, shift, spread):
    # A j_max larger than the leaves admits every trainable token, so T_i is fixed and only the assignment
    # of its targets to trajectories (and the draw order) depends on the seed.
    j_max = len(tree.leaves()) + 1
    logp = current_logp(tree, shift, spread)
    runs = []
    for seed in (seed_a, seed_b):
        admitted = admit(tree, BUILTIN, j_max=j_max, rng=seed)
        assert covered_targets(tree, admitted) == all_trainable(tree)
        runs.append(Assignment(tree, admitted, logp))
    first, second = (run.loss(advantage) for run in runs)
    assert_same(first, second)
    assert int(first["L"]) == len(all_trainable(tree))
    split = runs[1].loss_per_trajectory(advantage)
    assert_close(split["loss"], first["loss"])
    assert_close(split["grad"], first["grad"])


@settings(max_examples=100, deadline=None)
@given(role_trees(max_calls=8), st.integers(1, 4), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_random_trees_a_bounded_admission_with_the_same_target_set_gives_the_same_loss(tree, j_max, seed_a, seed_b):
    admitted = [admit(tree, BUILTIN, j_max=j_max, rng=seed) for seed in (seed_a, seed_b)]
    covered = [covered_targets(tree, a) for a in admitted]
    logp = current_logp(tree, 0.02, 0.05)
    first, second = (Assignment(tree, a, logp).loss(-0.7) for a in admitted)
    assert all(t.num_targets > 0 for a in admitted for t in a)
    if covered[0] == covered[1]:  # the same T_i, possibly carried by different trajectories in another order
        assert_same(first, second)
