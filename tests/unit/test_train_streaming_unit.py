"""gyre.trainer.streaming.accumulate_unit: a claim unit holding a split execution gives the gradient of one loss call
over the whole batch (s_i of Eq. 5 taken over all the execution's micro-steps by the no-grad pass)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gyre.config.loss import LossConfig
from gyre.data.microstep import TokenRow, build_microstep
from gyre.models.decoder import build_model
from gyre.models.decoder_config import DecoderConfig
from gyre.rl import policy_loss
from gyre.trainer.native_trainable import NativeTrainable
from gyre.trainer.streaming import accumulate_unit

CONFIG = DecoderConfig(
    model_type="qwen2",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
)


def rows(rng) -> list[TokenRow]:
    def row(execution: str, slot: int, num_targets: int, advantage: float) -> TokenRow:
        targets = np.array([False, False] + [True] * 6)
        return TokenRow(
            group_id=0,
            execution=execution,
            leaf=0,
            role="main",
            ids=rng.integers(0, 32, 8).astype(np.int64),
            targets=targets,
            behavior_logprobs=np.where(targets, rng.uniform(-5.0, -0.5, 8), 0.0),
            advantage=advantage,
            execution_num_targets=num_targets,
            batch_execution=slot,
        )

    return [row("split", 0, 12, 1.5), row("split", 0, 12, 1.5), row("other", 1, 6, -0.5)]


def with_log_ratio(trainable, row: TokenRow, log_ratio: float) -> TokenRow:
    """`row` with behavior log-probs set so that log rho = logp - behavior_logp = `log_ratio` at every target."""
    with torch.no_grad():
        logp = trainable.logprobs(build_microstep(0, 0, [row], num_executions=2)).double().numpy()
    return dataclasses.replace(row, behavior_logprobs=np.where(row.targets, logp - log_ratio, 0.0))


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_a_split_execution_unit_equals_one_call_over_the_batch():
    config = LossConfig()
    rng = np.random.default_rng(0)
    trainable = NativeTrainable(build_model(CONFIG, seed=1), lr=1e-3)
    split_a, split_b, other = rows(rng)
    # A_i > 0: the first part alone has s_i = e^0.5 > seq_clip_high (masked), the whole has s_i = e^-0.05 (kept),
    # so a per-part s_i would drop the first part's gradient.
    split_a, split_b = with_log_ratio(trainable, split_a, 0.5), with_log_ratio(trainable, split_b, -0.6)
    unit = (
        build_microstep(0, 0, [split_a, other], num_executions=2, split=("split",)),
        build_microstep(0, 1, [split_b], num_executions=2, split=("split",)),
    )
    total = accumulate_unit(trainable, unit, config)
    streamed = grads(trainable.model)

    trainable.model.zero_grad(set_to_none=True)
    whole = build_microstep(0, 0, [split_a, other, split_b], num_executions=2)  # nothing split: one call
    logp_T = trainable.logprobs(whole)[torch.from_numpy(whole.target_U)]
    loss, _ = policy_loss(logp_T, **whole.loss_inputs(), config=config)
    loss.backward()
    assert abs(total - loss.item()) <= 1e-6 * max(1.0, abs(loss.item()))
    torch.testing.assert_close(streamed, grads(trainable.model), rtol=1e-5, atol=1e-7)
    assert streamed.abs().sum() > 0
