"""The memory plan's activation term (`gyre.trainer.memory_plan.layer_activation_bytes`) against what gyre's Megatron
layers save for their backward on real gloo ranks: the bytes of every tensor a forward saves (parameters aside, each
storage once), per token, as the slope from 2 to 4 layers; a dense layer at EP 1, and MoE layers of two top-k and
expert widths at EP 1 and EP 2 (a MoE layer splits the tokens over the EP group: an EP rank's share of the expert
pairs, averaged over the ranks, whose routing differs). fp32, within 5%."""

from __future__ import annotations

import pytest

from gyre.distributed.local import run_local

TOKENS = 1024
QUIET = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
MOE = {
    "moe-top2-256": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "norm_topk_prob": True},
    "moe-top4-512": {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 512, "norm_topk_prob": True},
}


def config(layers: int, moe: dict):
    from gyre.models.decoder_config import DecoderConfig

    return DecoderConfig(
        model_type="qwen3_moe" if moe else "qwen3",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        qk_norm=True,
        tie_word_embeddings=True,
        **moe,
    )


def saved_bytes_per_token(cfg) -> float:
    from types import SimpleNamespace

    import numpy as np
    import torch

    from gyre.trainer.logprobs import microstep_logprobs
    from gyre.trainer.model import build_gpt_model

    model = build_gpt_model(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=TOKENS).astype(np.int64)
    step = SimpleNamespace(ids_U=ids, row_offsets_R1=np.arange(0, TOKENS + 1, TOKENS // 4, dtype=np.int64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        microstep_logprobs(model, step, chunk_tokens=TOKENS)
    return sum(seen.values()) / TOKENS


def worker(rank: int, world_size: int, *, moe: dict) -> float:
    """This rank's saved bytes per token of one layer (the slope from 2 to 4 layers)."""
    from gyre.trainer.model import init_model_parallel

    init_model_parallel(1, 1, seed=0, expert_parallel_size=world_size)
    return (saved_bytes_per_token(config(4, moe)) - saved_bytes_per_token(config(2, moe))) / 2


@pytest.mark.parametrize(
    ("name", "ep"), [("dense", 1), ("moe-top2-256", 1), ("moe-top4-512", 1), ("moe-top2-256", 2), ("moe-top4-512", 2)]
)
def test_a_layers_planned_activations_are_what_it_saves(name, ep):
    from gyre.trainer.memory_plan import layer_activation_bytes

    moe = MOE.get(name, {})
    ranks = run_local(f"{__file__}:worker", ep, kwargs={"moe": moe}, timeout_s=300, env=QUIET)
    planned = layer_activation_bytes(config(4, moe), 0, tp=1, ep=ep, dtype="float32")
    assert planned == pytest.approx(sum(ranks) / ep, rel=0.05), ranks
