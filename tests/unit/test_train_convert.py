"""gyre.trainer.convert: HF <-> Megatron state dicts. Round trips are bit-identical at every TP x PP layout, the TP
shards are the documented slices (q/k/v interleaved per KV group, gate and up split separately), and missing,
unexpected or mis-shaped tensors are refused with one ValueError before anything is loaded."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from gyre.models.decoder import build_model
from gyre.models.decoder_config import DecoderConfig
from gyre.trainer.convert import (
    gather_hf_state_dict,
    hf_to_megatron,
    load_hf_state_dict,
    megatron_to_hf,
    to_local_names,
    to_model_names,
)
from gyre.trainer.model import build_gpt_model, init_model_parallel

CONFIG = DecoderConfig(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    qk_norm=True,
    attention_qkv_bias=True,
)
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)


def hf_state(config: DecoderConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    model = build_model(config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    # Distinct values everywhere (norms and biases too), so a swapped or misplaced row cannot round-trip.
    return {n: torch.randn(t.shape, generator=generator) for n, t in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_round_trip_is_bit_identical(tp, pp, tied):
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    hf = hf_state(config)
    shards = [
        [hf_to_megatron(hf, config, tp_rank=r, tp_size=tp, pp_rank=s, pp_size=pp) for r in range(tp)] for s in range(pp)
    ]
    back = megatron_to_hf(shards, config)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    layers_per_stage = config.num_hidden_layers // pp
    assert all(f"decoder.layers.{layers_per_stage - 1}.mlp.linear_fc2.weight" in shard for shard in shards[-1])
    assert not any(f"decoder.layers.{layers_per_stage}.mlp.linear_fc2.weight" in shard for shard in shards[-1])
    # Tied at PP > 1: the last stage keeps its copy of the embedding as output_layer.
    assert ("output_layer.weight" in shards[-1][0]) == (not tied or pp > 1)


def test_tp_shards_are_the_documented_slices():
    hf = hf_state(CONFIG)
    rank1 = hf_to_megatron(hf, CONFIG, tp_rank=1, tp_size=2)
    D, C = CONFIG.head_dim, CONFIG.hidden_size
    attn = "model.layers.0.self_attn."
    # Rank 1 holds KV group 1: query heads 2 and 3, then key head 1, then value head 1.
    want_qkv = torch.cat(
        (
            hf[attn + "q_proj.weight"][2 * D : 4 * D],
            hf[attn + "k_proj.weight"][D : 2 * D],
            hf[attn + "v_proj.weight"][D:],
        )
    )
    assert torch.equal(rank1["decoder.layers.0.self_attention.linear_qkv.weight"], want_qkv)
    assert rank1["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (4 * D,)
    half = CONFIG.intermediate_size // 2
    want_fc1 = torch.cat(
        (hf["model.layers.0.mlp.gate_proj.weight"][half:], hf["model.layers.0.mlp.up_proj.weight"][half:])
    )
    assert torch.equal(rank1["decoder.layers.0.mlp.linear_fc1.weight"], want_fc1)
    assert torch.equal(
        rank1["decoder.layers.0.self_attention.linear_proj.weight"], hf[attn + "o_proj.weight"][:, 2 * D :]
    )
    assert torch.equal(rank1["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"][32:])
    assert rank1["output_layer.weight"].shape == (32, C)


def test_bad_hf_state_dicts_are_refused_with_every_problem_listed():
    hf = hf_state(CONFIG)
    del hf["model.layers.1.mlp.up_proj.weight"]
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 32)
    hf["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    with pytest.raises(ValueError) as info:
        hf_to_megatron(hf, CONFIG)
    message = str(info.value)
    assert "missing ['model.layers.1.mlp.up_proj.weight']" in message
    assert "unexpected ['model.layers.0.self_attn.o_proj.bias']" in message
    assert "model.layers.0.self_attn.k_proj.weight: got (5, 32), expected (24, 32)" in message


def test_tied_checkpoint_with_a_different_lm_head_is_refused():
    config = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    hf = hf_state(config)
    hf_to_megatron({**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()}, config)  # equal: tolerated
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        hf_to_megatron({**hf, "lm_head.weight": torch.zeros(64, 32)}, config)


@pytest.mark.slow
def test_load_checks_everything_before_copying_and_gathers_back(tmp_path):
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        init_model_parallel(1, 1)
        model = build_gpt_model(CONFIG)
        before = {n: t.clone() for n, t in model.state_dict().items() if torch.is_tensor(t)}
        wrong = dataclasses.replace(CONFIG, intermediate_size=40)  # a checkpoint of another shape
        with pytest.raises(ValueError, match=r"linear_fc1.weight: got \(80, 32\), expected \(96, 32\)"):
            load_hf_state_dict(model, hf_state(wrong), wrong)
        after = model.state_dict()
        assert all(torch.equal(after[n], t) for n, t in before.items()), "nothing may be loaded on a failed check"
        hf = hf_state(CONFIG)
        load_hf_state_dict(model, hf, CONFIG)
        back = gather_hf_state_dict(model, CONFIG)
        assert sorted(back) == sorted(hf) and all(torch.equal(back[n], t) for n, t in hf.items())
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def test_transformer_engine_fused_norm_names_round_trip():
    megatron = hf_to_megatron(hf_state(CONFIG), CONFIG)
    te_names = {to_model_names({n: t}, ()).popitem()[0] for n, t in megatron.items()}  # a local model: unchanged
    assert te_names == set(megatron)
    fused = {
        n.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight").replace(
            "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"
        )
        for n in megatron
    }
    renamed = to_model_names(megatron, fused)
    assert set(renamed) == fused and "decoder.layers.0.input_layernorm.weight" not in renamed
    assert to_local_names(renamed) == megatron
