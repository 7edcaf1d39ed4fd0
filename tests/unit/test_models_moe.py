"""The shared decoder's Qwen3-MoE / Qwen2-MoE layout: config parsing, the routing math by hand, transformers parity,
checkpoint names (per-expert and transformers 5's fused), the engine's cache paths, routing replay, the builder."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.testing import assert_close

from gyre.models import PAD_TOKEN, DecoderConfig, build_model, load_pretrained, load_tokenizer, save_pretrained
from gyre.models.decoder import KVCache, SparseMoeBlock, route_tokens
from gyre.models.hf_weights import split_fused_experts
from gyre.models.moe import build_qwen3_moe_model, tiny_qwen3_moe_config

TOL = {"atol": 1e-5, "rtol": 0.0}  # as the dense parity tests (tests/unit/test_engine_model.py)
# The cache paths attend through other kernels (one-query matmuls, a masked SDPA) than the full forward; with
# hidden 64 the logits reach |6| (fp32 ulp 5e-7), so their float noise reaches ~1e-5 (1.04e-5 seen): 3e-5.
CACHE_TOL = {"atol": 3e-5, "rtol": 0.0}
VOCAB = 61


def moe_hf_config(model_type: str = "qwen3_moe", **overrides) -> dict:
    """hidden 64, 4 layers (layer 0 dense), 8 experts, top-2, expert width 32: both kinds of layer."""
    config = {
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 500.0,
        "max_position_embeddings": 128,
        "hidden_act": "silu",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    }
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = 48
    config.update(overrides)
    return config


def random_moe_model(model_type: str = "qwen3_moe", seed: int = 0, **overrides):
    """Every parameter random (norms around 1), so routing differs between tokens and no term is vacuous."""
    model = build_model(DecoderConfig.from_hf(moe_hf_config(model_type, **overrides)), seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") else 0.2
            param.copy_(
                (1.0 if name.endswith("norm.weight") else 0.0) + scale * torch.randn(param.shape, generator=generator)
            )
    return model.eval()


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def positions(batch: int, length: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + length).expand(batch, length).clone()


# --------------------------------------------------------------------------------------------------- config


def test_moe_fields_are_read_with_transformers_rule_and_round_trip():
    config = DecoderConfig.from_hf(moe_hf_config(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True))
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.norm_topk_prob and config.qk_norm and config.mlp_only_layers == (3,)
    # (i + 1) % 2 == 0 -> layers 1 and 3; layer 3 is mlp-only
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert config.moe_layer_ids() == (1,)
    assert DecoderConfig.from_hf(config.to_hf()) == config
    assert config.to_hf()["architectures"] == ["Qwen3MoeForCausalLM"]


def test_transformers5_spelling_and_defaults():
    """transformers 5 writes Qwen3Moe's num_experts as num_local_experts; omitted fields take the class defaults."""
    hf = moe_hf_config()
    hf["num_local_experts"] = hf.pop("num_experts")
    for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "head_dim"):
        hf.pop(name)
    hf["num_local_experts"] = 128
    config = DecoderConfig.from_hf(hf)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert config.decoder_sparse_step == 1 and config.mlp_only_layers == () and not config.norm_topk_prob
    assert config.head_dim == 16  # Qwen3MoeConfig has no head_dim default of 128: hidden // heads
    assert config.router_aux_loss_coef == 0.001


def test_qwen2_moe_config():
    config = DecoderConfig.from_hf(moe_hf_config("qwen2_moe"))
    assert config.shared_expert_intermediate_size == 48
    assert config.attention_qkv_bias and not config.attention_out_bias and not config.qk_norm
    assert DecoderConfig.from_hf(config.to_hf()) == config
    assert not DecoderConfig.from_hf(moe_hf_config("qwen2_moe", qkv_bias=False)).attention_qkv_bias


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"model_type": "mixtral"}, "model_type='mixtral' is a mixture-of-experts"),
        ({"model_type": "deepseek_v3"}, "deepseek_v3"),
        ({"model_type": "qwen3", "num_experts": 8}, "num_experts=8"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
        ({"mlp_only_layers": [4]}, "mlp_only_layers"),
        ({"decoder_sparse_step": -1}, "decoder_sparse_step=-1"),
    ],
)
def test_moe_config_errors_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig.from_hf({**moe_hf_config(), **overrides})


def test_shared_expert_only_for_qwen2_moe():
    base = DecoderConfig.from_hf(moe_hf_config())
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=16"):
        DecoderConfig(**{**base.__dict__, "shared_expert_intermediate_size": 16})
    with pytest.raises(ValueError, match="num_experts=8"):
        DecoderConfig(**{**base.__dict__, "model_type": "qwen3"})


# --------------------------------------------------------------------------------------------------- routing


def test_route_tokens_by_hand():
    """Logits log(1), log(2), log(3), log(4): probabilities 0.1, 0.2, 0.3, 0.4; top-2 = experts 3, 2."""
    logits = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]])
    weights, experts = route_tokens(logits, 2, norm_topk_prob=False)
    assert experts.tolist() == [[3, 2]]
    assert_close(weights, torch.tensor([[0.4, 0.3]]))
    weights, _ = route_tokens(logits, 2, norm_topk_prob=True)
    assert_close(weights, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]))
    # replay: the given experts, weighted by their probabilities (renormalized over them)
    weights, experts = route_tokens(logits, 2, norm_topk_prob=True, routed_NK=torch.tensor([[0, 1]]))
    assert experts.tolist() == [[0, 1]]
    assert_close(weights, torch.tensor([[1 / 3, 2 / 3]]))


def test_block_equals_a_sum_over_experts_written_out():
    """The gather / index_add loop equals sum_k w_k * expert_k(x) computed token by token."""
    config = DecoderConfig.from_hf(moe_hf_config(norm_topk_prob=True))
    block = SparseMoeBlock(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        out, experts = block(x)
        want = torch.zeros(10, 64)
        for n, x_C in enumerate(x.reshape(10, 64)):
            probs = block.gate(x_C).softmax(-1)
            top = probs.topk(2)
            for w, e in zip(top.values / top.values.sum(), top.indices, strict=True):
                assert int(e) in experts[n].tolist()
                want[n] += w * block.experts[int(e)](x_C)
    assert_close(out.reshape(10, 64), want, **TOL)


# --------------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2}), ("qwen2_moe", {})],
)
def test_parity_with_transformers(model_type, overrides, tmp_path):
    """gyre's save loads into transformers' Qwen3Moe/Qwen2MoeForCausalLM with the same logits, and the
    checkpoint transformers saves loads back into gyre."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the dev extra) is not installed; parity test not run"
    )
    model = random_moe_model(model_type, **overrides)
    save_pretrained(model, tmp_path / "ours")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert (
        type(hf_model).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[model_type]
    )
    ids, pos = tokens(2, 12, seed=7), positions(2, 12, start=3)
    with torch.no_grad():
        ours, _ = model(ids, pos)
        theirs = hf_model(input_ids=ids, position_ids=pos).logits
    assert_close(ours, theirs.float(), **TOL)
    hf_model.save_pretrained(str(tmp_path / "theirs"))
    reloaded = load_pretrained(tmp_path / "theirs")
    assert reloaded.config == model.config
    with torch.no_grad():
        assert_close(reloaded(ids, pos)[0], ours, **TOL)
    # transformers 5 keeps experts fused in memory: that state dict splits into gyre's per-expert names exactly
    fused = dict(hf_model.state_dict())
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in fused)
    split = split_fused_experts(fused)
    assert set(split) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(split[name], tensor), name


def test_checkpoint_names_are_the_hub_names(tmp_path):
    model = random_moe_model("qwen2_moe")
    save_pretrained(model, tmp_path)
    names = set(model.state_dict())
    assert "model.layers.0.mlp.gate_proj.weight" in names  # mlp-only layer
    assert "model.layers.1.mlp.gate.weight" in names
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.1.mlp.experts.7.{proj}.weight" in names
        assert f"model.layers.1.mlp.shared_expert.{proj}.weight" in names
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names
    assert model.state_dict()["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
    reloaded = load_pretrained(tmp_path)
    ids, pos = tokens(1, 6), positions(1, 6)
    with torch.no_grad():
        assert torch.equal(reloaded(ids, pos)[0], model(ids, pos)[0])


def test_fused_checkpoint_loads(tmp_path):
    """A safetensors file in transformers 5's fused layout loads like the per-expert one."""
    from safetensors.torch import save_file

    model = random_moe_model()
    save_pretrained(model, tmp_path)
    state = model.state_dict()
    fused = {}
    for name, tensor in state.items():
        if ".mlp.experts." not in name:
            fused[name] = tensor.contiguous()
    for i in model.config.moe_layer_ids():
        p = f"model.layers.{i}.mlp.experts."
        E = model.config.num_experts
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat((state[f"{p}{j}.gate_proj.weight"], state[f"{p}{j}.up_proj.weight"])) for j in range(E)]
        )
        fused[p + "down_proj"] = torch.stack([state[f"{p}{j}.down_proj.weight"] for j in range(E)])
    (tmp_path / "model.safetensors").unlink()
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reloaded = load_pretrained(tmp_path)
    ids, pos = tokens(2, 6), positions(2, 6)
    with torch.no_grad():
        assert torch.equal(reloaded(ids, pos)[0], model(ids, pos)[0])


# --------------------------------------------------------------------------------------------------- engine paths


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_cache_paths_equal_the_full_forward(model_type):
    """As gyre.engine.native calls the model: prefill into a buffer with room (kv_cache_length, one logit kept),
    then one-token decodes over a batch buffer with a mask; logits and the routed experts equal the full forward."""
    model = random_moe_model(model_type)
    config = model.config
    B, prompt, new = 2, 7, 4
    ids = tokens(B, prompt + new, seed=3)
    with torch.no_grad():
        full, _, routed_full = model(ids, positions(B, prompt + new), return_routed_experts=True)
        shape = (B, config.num_key_value_heads, prompt + new, config.head_dim)
        room = KVCache(tuple(torch.zeros(shape) for _ in range(4)), tuple(torch.zeros(shape) for _ in range(4)))
        logits, _, routed = model(
            ids[:, :prompt],
            positions(B, prompt),
            kv_cache=room,
            num_logits_to_keep=1,
            kv_cache_length=0,
            return_routed_experts=True,
        )
        assert_close(logits[:, -1], full[:, prompt - 1], **CACHE_TOL)
        assert torch.equal(routed, routed_full[:, :prompt])
        for t in range(prompt, prompt + new):
            mask = torch.ones(B, 1, 1, t + 1, dtype=torch.bool)
            logits, _, routed = model(
                ids[:, t : t + 1],
                positions(B, 1, start=t),
                kv_cache=room,
                attention_mask=mask,
                kv_cache_length=t,
                return_routed_experts=True,
            )
            assert_close(logits[:, -1], full[:, t], **CACHE_TOL)
            assert torch.equal(routed, routed_full[:, t : t + 1])
    assert routed_full.dtype == torch.int32 and routed_full.shape == (B, prompt + new, 4, 2)
    assert (routed_full[:, :, 0] == -1).all() and (routed_full[:, :, 1:] >= 0).all()  # layer 0 is dense


# --------------------------------------------------------------------------------------------------- replay


def test_replaying_the_chosen_experts_gives_identical_logits_and_other_experts_change_them():
    model = random_moe_model(norm_topk_prob=True)
    ids, pos = tokens(2, 9, seed=5), positions(2, 9)
    with torch.no_grad():
        logits, _, routed = model(ids, pos, return_routed_experts=True)
        replayed, _, routed_again = model(ids, pos, routed_experts_BTLK=routed, return_routed_experts=True)
        assert torch.equal(replayed, logits)
        assert torch.equal(routed_again, routed)
        hidden = model.final_hidden(ids, pos, routed_experts_BTLK=routed)
        assert torch.equal(torch.nn.functional.linear(hidden, model.output_weight), logits)
        forced = (routed + 1) % model.config.num_experts  # every token to other experts (still distinct)
        forced[:, :, 0] = -1  # ignored: layer 0 is dense
        changed, _, used = model(ids, pos, routed_experts_BTLK=forced, return_routed_experts=True)
    assert torch.equal(used, forced)
    assert (changed - logits).abs().max() > 1e-2


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_gradient_reaches_the_router_under_replay(recompute):
    model = random_moe_model(norm_topk_prob=True).train()
    ids, pos = tokens(1, 8, seed=2), positions(1, 8)
    with torch.no_grad():
        _, _, routed = model(ids, pos, return_routed_experts=True)
    forced = (routed + 3) % model.config.num_experts
    hidden = model.final_hidden(ids, pos, recompute=recompute, routed_experts_BTLK=forced)
    hidden.square().sum().backward()
    for i in model.config.moe_layer_ids():
        grad = model.model.layers[i].mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0, i
    # only the replayed experts were used: an expert no token was forced to has no gradient
    layer = model.model.layers[1].mlp
    unused = set(range(8)) - set(forced[:, :, 1].flatten().tolist())
    for e in unused:
        assert layer.experts[e].down_proj.weight.grad is None


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda r: r[:, :, :, :1], "num_experts_per_tok"),
        (lambda r: r.float(), "integer"),
        (lambda r: torch.where(r >= 0, 8, r), r"in \[0, 8\)"),
        (lambda r: torch.where(r >= 0, 1, r), "distinct"),
    ],
)
def test_bad_replay_is_refused(bad, match):
    model = random_moe_model()
    ids, pos = tokens(1, 4), positions(1, 4)
    with torch.no_grad():
        _, _, routed = model(ids, pos, return_routed_experts=True)
        with pytest.raises(ValueError, match=match):
            model(ids, pos, routed_experts_BTLK=bad(routed))


def test_dense_model_takes_no_routing():
    hf = {**moe_hf_config(), "model_type": "qwen3"}
    for name in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
    ):
        hf.pop(name)
    dense = build_model(DecoderConfig.from_hf(hf))
    ids, pos = tokens(1, 3), positions(1, 3)
    with pytest.raises(ValueError, match="dense"):
        dense(ids, pos, return_routed_experts=True)
    with pytest.raises(ValueError, match="dense"):
        dense(ids, pos, routed_experts_BTLK=torch.zeros(1, 3, 4, 2, dtype=torch.long))


# --------------------------------------------------------------------------------------------------- builder


def test_build_qwen3_moe_model(tmp_path):
    out = build_qwen3_moe_model(tmp_path / "a", seed=1)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    )
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["num_experts"] == 8
    model = load_pretrained(out)
    tokenizer = load_tokenizer(out)
    assert model.config.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert hf["pad_token_id"] == tokenizer.token_to_id(PAD_TOKEN) is not None
    assert model.config.moe_layer_ids() == (1, 2, 3)
    again = build_qwen3_moe_model(tmp_path / "b", seed=1)
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="seed"):
        build_qwen3_moe_model(tmp_path / "c", seed=-1)


def test_a_token_the_engine_did_not_route_takes_the_routers_own_experts():
    """Rows of all -1 (NO_ROUTE: a position no recorded call fed) replay nothing: the router chooses there, so a
    replay with gaps equals the router's forward at the gaps; a partly -1 row is refused."""
    config = tiny_qwen3_moe_config(vocab_size=64, bos_token_id=None, eos_token_id=None)
    model = build_model(config, seed=1).eval()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None]
    with torch.no_grad():
        own, _, chosen = model(ids, positions, return_routed_experts=True)
        gaps = chosen.clone()
        gaps[0, 3:6] = -1  # three tokens not routed at any layer
        replayed, _ = model(ids, positions, routed_experts_BTLK=gaps)
    assert torch.equal(own, replayed)
    partial = chosen.clone()
    moe_layer = config.moe_layer_ids()[0]
    partial[0, 2, moe_layer, 0] = -1
    with pytest.raises(ValueError, match="or all -1"):
        model(ids, positions, routed_experts_BTLK=partial)
