"""End to end: micro-steps emitted by the stream packing buffer, fed to `gyre.rl.policy_loss`, sum to the loss
and gradients of one call over all rows of the batch (Eq. 6 with the batch's B * N denominator).

Two ways a trainer may use the micro-steps, both checked:
- rows of one execution spread over micro-steps: each call gets L_i (`num_targets_E`) from the micro-step
  and s_i (`seq_ratio_E`) accumulated by a no-grad pass over the batch's micro-steps;
- `keep_executions_together`: every execution's targets are in one call, the loss's default contract.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gyre.data import MicroStep, PackingConfig, StreamPackingBuffer, TrajectoryBuffer, materialize_group
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


def run_stream(keep_executions_together: bool) -> list[MicroStep]:
    config = PackingConfig(
        batch_groups=2,
        group_size=3,
        max_tokens_per_microstep=26 if keep_executions_together else 20,
        keep_executions_together=keep_executions_together,
        min_fill=0.0,
    )
    packer = StreamPackingBuffer(build_buffer(), config)
    packer.top_up(min_pending=1000)
    assert packer.closed
    steps = []
    while (step := packer.queue.claim(0)) is not None:
        steps.append(step)
    return steps


def step_logp(step: MicroStep, logps: dict[tuple[str, int], torch.Tensor]) -> torch.Tensor:
    rows = zip(step.row_execution_R.tolist(), step.row_leaf_R.tolist(), strict=True)
    return torch.cat([logps[(step.execution_ids[e], leaf)] for e, leaf in rows])


@pytest.mark.parametrize("keep_executions_together", [False, True])
def test_micro_step_losses_sum_to_the_one_call_loss(keep_executions_together):
    config = LossConfig()
    logps = current_logps()
    expected, metrics = reference(logps, config)
    assert 0 < metrics["clip_fraction"] < 1  # the shared mask m_i matters in this case
    expected.backward()
    expected_grads = {key: t.grad.clone() for key, t in logps.items()}
    for t in logps.values():
        t.grad = None

    steps = run_stream(keep_executions_together)
    split = {e for e in "abdef" if sum(e in step.execution_ids for step in steps) > 1}
    assert len(steps) > 1 and (split == set() if keep_executions_together else len(split) > 0)

    # No-grad pass: s_i over each execution's whole target set (Eq. 5), accumulated over the micro-steps.
    log_sum = {e: torch.zeros((), dtype=torch.float64) for e in "abdef"}
    count = dict.fromkeys("abdef", 0)
    for step in steps:
        inputs = step.loss_inputs(torch.float64)
        with torch.no_grad():
            log_ratio_T = step_logp(step, logps)[torch.from_numpy(step.target_U)] - inputs["behavior_logp_T"]
        sums_E, counts_E = sequence_log_ratio_sums(log_ratio_T, inputs["execution_T"], len(step.execution_ids))
        for k, e in enumerate(step.execution_ids):
            log_sum[e] = log_sum[e] + sums_E[k]
            count[e] += int(counts_E[k])
    assert all(count[e] == step.num_targets_E[k] for step in steps for k, e in enumerate(step.execution_ids))
    s = {e: finalize_sequence_ratio(log_sum[e].reshape(1), torch.tensor([count[e]]))[0] for e in log_sum}

    total = torch.zeros((), dtype=torch.float64)
    per_part_mask = torch.zeros((), dtype=torch.float64)
    for step in steps:
        inputs = step.loss_inputs(torch.float64)  # num_executions (B * N = 6), behavior, execution, A_i, L_i
        assert inputs["num_executions"] == 6
        if keep_executions_together:
            inputs.pop("num_targets_E")  # the loss's default contract: L_i = the targets present
        logp_T = step_logp(step, logps)[torch.from_numpy(step.target_U)]
        with torch.no_grad():
            per_part_mask += policy_loss(logp_T, **inputs, config=config)[0]
        if not keep_executions_together:
            inputs["seq_ratio_E"] = torch.stack([s[e] for e in step.execution_ids])
        loss, _ = policy_loss(logp_T, **inputs, config=config)
        total = total + loss
    total.backward()
    if not keep_executions_together:  # the case needs s_i over the whole execution: per-part masks differ
        assert abs(per_part_mask.item() - expected.item()) > 1e-4
    torch.testing.assert_close(total, expected)
    for key, t in logps.items():
        torch.testing.assert_close(t.grad, expected_grads[key])
