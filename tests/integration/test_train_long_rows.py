"""The Megatron trainer's long-row path against the path it replaced, at TP = 1 and TP = 2 (real gloo ranks).

New: one forward per micro-step over the packed rows in THD form, gyre's SDPA core attention, log-probs from the
final hidden states a chunk of tokens at a time (`gyre.trainer.logprobs`). Old: one forward per row under a dense
`L x L` mask through megatron's own `DotProductAttention`, the full vocab-parallel logits, megatron's cross
entropy. Same weights: the log-probs and every gradient shard agree to 1e-5 (fp32), with recompute none,
selective and full.
"""

from __future__ import annotations

import itertools

import pytest

from gyre.distributed.local import run_local

ROW_LENGTHS = (9, 1, 23, 5, 14)


def compare_worker(rank: int, world_size: int, *, recompute: str) -> dict:
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from gyre.models.decoder import build_model
    from gyre.models.decoder_config import DecoderConfig
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.logprobs import block_causal_mask, packed_logprobs, packed_positions
    from gyre.trainer.model import build_gpt_model, init_model_parallel

    init_model_parallel(tensor_parallel_size=world_size, seed=0)
    config = DecoderConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        rope_theta=500.0,
        qk_norm=True,
    )
    native = build_model(config, seed=7)  # the same weights on every rank
    model = build_gpt_model(config, recompute=recompute)
    load_hf_state_dict(model, native.state_dict(), config)
    model.train()
    reference = build_gpt_model(config)
    load_hf_state_dict(reference, native.state_dict(), config)
    reference.train()
    for layer in reference.decoder.layers:  # megatron's own dense attention (parameter-free: a plain swap)
        old = layer.self_attention.core_attention
        layer.self_attention.core_attention = DotProductAttention(
            reference.config, old.layer_number, old.attn_mask_type, "self"
        )

    generator = torch.Generator().manual_seed(3)
    ids_U = torch.randint(0, config.vocab_size, (sum(ROW_LENGTHS),), generator=generator)
    offsets = [0, *itertools.accumulate(ROW_LENGTHS)]
    scale_U = torch.randn(ids_U.numel(), generator=generator)

    got = packed_logprobs(model, ids_U, offsets, chunk_tokens=4)
    (got * scale_U).sum().backward()

    parts = []
    positions_U = packed_positions(offsets, ids_U.numel())
    for start, end in itertools.pairwise(offsets):  # the old path: a row at a time, dense mask, full logits
        positions = positions_U[start:end]
        logits_1LV = reference(ids_U[None, start:end], positions[None], block_causal_mask(positions))
        nll = vocab_parallel_cross_entropy(
            logits_1LV[:, :-1].float().transpose(0, 1).contiguous(), ids_U[None, start + 1 : end].transpose(0, 1)
        )
        parts += [torch.zeros(1), -nll[:, 0]]
    want = torch.cat(parts)
    (want * scale_U).sum().backward()

    grads = {}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        grads[name] = (p.grad - q.grad).abs().max().item()
    return {"logp": (got - want).abs().max().item(), "grads": grads, "num_grads": len(grads)}


@pytest.mark.parametrize(("world_size", "recompute"), [(1, "none"), (2, "none"), (1, "selective"), (2, "full")])
def test_thd_sdpa_and_chunked_logprobs_equal_the_dense_path(world_size, recompute):
    """Selective recompute reruns the core attention (gyre's) in the backward, full every layer: same gradients."""
    results = run_local(
        f"{__file__}:compare_worker",
        world_size,
        kwargs={"recompute": recompute},
        timeout_s=180,
        env={"PYTHONWARNINGS": "ignore"},
    )
    for rank, result in enumerate(results):
        assert result["num_grads"] > 10
        assert result["logp"] <= 1e-5, (rank, result["logp"])
        worst = max(result["grads"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, (rank, worst)
