"""End to end: micro-steps emitted by the stream packing buffer, fed to `gyre.rl.policy_loss`, sum to the loss
and gradients of one call over all rows of the batch (Eq. 6 with the batch's B * N denominator).

With the default `PackingConfig` an execution that fits the budget is kept in one micro-step (its s_i and
mask m_i need nothing else); one larger than the budget is split over consecutive micro-steps and flagged in
`split_E`. For the micro-steps with split executions the trainer accumulates s_i (`seq_ratio_E`) over them by
`batch_execution_E` in a no-grad pass; `loss_inputs()` refuses to build the per-part mask without it.
Also checked: `keep_executions_together=False` (rows pack freely), and that the per-part mask differs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gyre.config import PackingConfig
from gyre.data import MicroStep, StreamPackingBuffer, TrajectoryBuffer, materialize_group
from gyre.rl import LossConfig, finalize_sequence_ratio, policy_loss, sequence_log_ratio_sums
from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree
from gyre.traj.admission import AdmittedTrajectory

SYS, USR, TOOL = Provenance.SYSTEM, Provenance.USER, Provenance.TOOL
REWARDS = ({"a": 1.0, "b": 0.0, "c": None}, {"d": 0.2, "e": 0.9, "f": 0.4})  # c is excluded: B * N = 6


def out(*ids: int) -> Response:
    return Response.build(list(ids), [-i / 100 for i in ids], "stop")


def tree_of(execution: str, branch_tokens: int) -> TrajectoryTree:
    """A shared prefix with two outputs, then two branches; the second has `branch_tokens` tool tokens."""
    tree = TrajectoryTree(execution, 100)
    tree.insert([Segment(SYS, [1, 2, 3]), Segment(USR, [10, 11])], out(20, 21), CallMeta(execution, "r0"))
    tree.insert([Segment(TOOL, [30])], out(40, 43), CallMeta(execution, "r1"), parent=3)
    tree.insert([Segment(TOOL, [31] * branch_tokens)], out(41, 42, 44), CallMeta(execution, "r2"), parent=3)
    return tree


def build_buffer() -> TrajectoryBuffer:
    buffer = TrajectoryBuffer()
    for group_id, rewards in enumerate(REWARDS):
        buffer.add_group(group_id, 0, list(rewards))
        admitted = {}
        for k, e in enumerate(rewards):
            tree = tree_of(e, 1 + 2 * k + group_id)
            buffer.attach_tree(tree)
            first, second = (tree.path_tokens(leaf) for leaf in tree.leaves())
            shared = np.zeros_like(second.target_mask)
            shared[: tree.nodes[3].prefix_tokens] = True  # the shared prefix is a target of the first row only
            admitted[e] = [
                AdmittedTrajectory(e, tree.leaves()[0], "main", first.target_mask.copy()),
                AdmittedTrajectory(e, tree.leaves()[1], "sub-agent", second.target_mask & ~shared),
            ]
        buffer.mark_ready(group_id, rewards, admitted)
    return buffer


def current_logps() -> dict[tuple[str, int], torch.Tensor]:
    """The 'trainer's' log-probs per row (leaf tensors): behavior + a drift per row + noise. f (A < 0) is
    clipped as a whole; a (A > 0) and d (A < 0) are kept as a whole, but their first row alone falls
    outside the clip interval [0.995, 1.005], so deciding m_i per micro-step would be wrong."""
    rng = np.random.default_rng(3)
    drift = {"a": (0.03, -0.03), "b": (-0.001, 0.0), "d": (-0.03, 0.03), "e": (0.0, 0.001), "f": (-0.01, -0.01)}
    logps = {}
    buffer = build_buffer()
    for group_id in (0, 1):
        for row in materialize_group(buffer.group(group_id)):
            noise = rng.normal(0.0, 0.0005, row.num_tokens)
            row_drift = drift[row.execution][0 if row.role == "main" else 1]
            logp = np.where(row.targets, row.behavior_logprobs + row_drift + noise, -1.0)
            logps[(row.execution, row.leaf)] = torch.tensor(np.minimum(logp, 0.0), requires_grad=True)
    return logps


def reference(logps: dict[tuple[str, int], torch.Tensor], config: LossConfig) -> tuple[torch.Tensor, dict]:
    """One policy_loss call over every row of the batch."""
    buffer = build_buffer()
    rows = [row for group_id in (0, 1) for row in materialize_group(buffer.group(group_id))]
    executions = list(dict.fromkeys(row.execution for row in rows))
    target = torch.from_numpy(np.concatenate([row.targets for row in rows]))
    logp = torch.cat([logps[(row.execution, row.leaf)] for row in rows])[target]
    behavior = torch.from_numpy(np.concatenate([row.behavior_logprobs for row in rows]))[target]
    execution = torch.tensor(np.concatenate([np.full(row.num_tokens, executions.index(row.execution)) for row in rows]))
    advantage = torch.tensor([next(r.advantage for r in rows if r.execution == e) for e in executions])
    return policy_loss(logp, behavior, execution[target], advantage, 6, config)


def run_stream(budget: int, **overrides) -> list[MicroStep]:
    config = PackingConfig(batch_groups=2, group_size=3, max_tokens_per_microstep=budget, **overrides)
    packer = StreamPackingBuffer(build_buffer(), config)
    packer.top_up(min_pending=1000)
    assert packer.closed and packer.rejected_groups() == []
    steps = []
    while (step := packer.queue.claim(0)) is not None:
        steps.append(step)
    return steps


def step_logp(step: MicroStep, logps: dict[tuple[str, int], torch.Tensor]) -> torch.Tensor:
    rows = zip(step.row_execution_R.tolist(), step.row_leaf_R.tolist(), strict=True)
    return torch.cat([logps[(step.execution_ids[e], leaf)] for e, leaf in rows])


# Executions a..f have 21, 23, -, 22, 24, 26 tokens (two rows each; c is excluded). Budget 21 with the
# defaults keeps a whole and splits b, d, e, f; 26 keeps every execution whole; rows packed freely at 20.
CASES = {
    "defaults, some split": (21, {}, set("bdef")),
    "defaults, none split": (26, {}, set()),
    "rows packed freely": (20, {"keep_executions_together": False}, set("abdef")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_micro_step_losses_sum_to_the_one_call_loss(case):
    budget, overrides, expected_split = CASES[case]
    config = LossConfig()
    logps = current_logps()
    expected, metrics = reference(logps, config)
    assert 0 < metrics["clip_fraction"] < 1  # the shared mask m_i matters in this case
    expected.backward()
    expected_grads = {key: t.grad.clone() for key, t in logps.items()}
    for t in logps.values():
        t.grad = None

    steps = run_stream(budget, **overrides)
    where = {e: [k for k, step in enumerate(steps) if e in step.execution_ids] for e in "abdef"}
    assert {e for e, ks in where.items() if len(ks) > 1} == expected_split
    slot = {"a": 0, "b": 1, "d": 3, "e": 4, "f": 5}  # group position * N + member index (c: 2, excluded)
    for step in steps:
        assert step.split_E.tolist() == [e in expected_split for e in step.execution_ids]
        assert step.batch_execution_E.tolist() == [slot[e] for e in step.execution_ids]
        if step.has_split:
            with pytest.raises(ValueError, match=r"sequence_log_ratio_sums .* batch_execution_E"):
                step.loss_inputs()
    if not overrides:  # with the defaults a split execution's micro-steps are consecutive
        assert all(ks == list(range(ks[0], ks[0] + len(ks))) for ks in where.values())

    # No-grad pass over the micro-steps with split executions: s_i over each execution's whole target set
    # (Eq. 5), accumulated by batch slot (then all-reduced over cells: one cell here).
    acc_2B = torch.zeros(2, steps[0].num_executions, dtype=torch.float64)
    for step in steps:
        if not step.has_split:
            continue
        inputs = step.target_inputs(torch.float64)
        with torch.no_grad():
            log_ratio_T = step_logp(step, logps)[torch.from_numpy(step.target_U)] - inputs["behavior_logp_T"]
        sum_E, count_E = sequence_log_ratio_sums(log_ratio_T, inputs["execution_T"], inputs["num_local"])
        acc_2B.index_add_(1, torch.from_numpy(step.batch_execution_E), torch.stack([sum_E, count_E.double()]))
    for step in steps:
        if step.has_split:
            assert acc_2B[1][step.batch_execution_E].tolist() == step.num_targets_E.tolist()
    s_B = finalize_sequence_ratio(acc_2B[0], acc_2B[1])

    total = torch.zeros((), dtype=torch.float64)
    per_part_mask = torch.zeros((), dtype=torch.float64)
    for step in steps:
        logp_T = step_logp(step, logps)[torch.from_numpy(step.target_U)]
        with torch.no_grad():
            partial = step.loss_inputs(torch.float64, allow_partial_seq_ratio=True)
            per_part_mask += policy_loss(logp_T, **partial, config=config)[0]
        if step.has_split:
            inputs = step.loss_inputs(torch.float64, seq_ratio_E=s_B[torch.from_numpy(step.batch_execution_E)])
        else:
            inputs = step.loss_inputs(torch.float64)  # every execution whole here: nothing else needed
        assert inputs["num_executions"] == 6  # B * N, c included
        loss, _ = policy_loss(logp_T, **inputs, config=config)
        total = total + loss
    total.backward()
    if expected_split:  # d (split in every such case): its first row alone is outside the clip interval
        assert abs(per_part_mask.item() - expected.item()) > 1e-4
    torch.testing.assert_close(total, expected)
    for key, t in logps.items():
        torch.testing.assert_close(t.grad, expected_grads[key])
