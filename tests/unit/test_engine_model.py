"""The native dense decoder: HF config parsing, save/load round trips, KV cache, packed rows, an independent
slow reference written from the equations, transformers parity (where it imports) and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.testing import assert_close

from gyre.models import (
    DecoderConfig,
    DecoderLM,
    block_causal_mask,
    build_model,
    load_pretrained,
    rope_inv_freq,
    save_pretrained,
    segments_from_positions,
)

MODEL_TYPES = ("llama", "qwen2", "qwen3")
TOL = {"atol": 1e-5, "rtol": 0.0}


def tiny_hf_config(model_type: str, **overrides) -> dict:
    """A tiny config.json of each family: GQA (4 query heads over 2 kv heads), head_dim != hidden / heads."""
    config = {
        "model_type": model_type,
        "vocab_size": 61,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500.0,  # small base: positions 0..40 rotate every frequency noticeably
        "max_position_embeddings": 128,
        "tie_word_embeddings": model_type == "qwen2",  # exercise both tied and untied
        "hidden_act": "silu",
    }
    if model_type == "llama":
        config["attention_bias"] = True  # llama with bias on q/k/v/o and the MLP, to test every bias path
        config["mlp_bias"] = True
    config.update(overrides)
    return config


def random_model(model_type: str, seed: int = 0, **overrides) -> DecoderLM:
    """Every parameter random, norms around 1 and biases nonzero, so no term of the forward is vacuous."""
    model = build_model(DecoderConfig.from_hf(tiny_hf_config(model_type, **overrides)), seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def tokens(batch: int, length: int, vocab: int = 61, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def arange_positions(batch: int, length: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + length).expand(batch, length).clone()


# ---------------------------------------------------------------------------------------------------------
# An independent reference: one token at a time, from the equations, reading the HF-named checkpoint tensors.


def reference_logits(state: dict[str, torch.Tensor], cfg: dict, ids: list[int], pos: list[int]) -> torch.Tensor:
    """Logits [T, V] of one sequence in float64 with plain loops: no module of gyre.engine is used."""
    sd = {k: v.double() for k, v in state.items()}
    model_type = cfg["model_type"]
    H, K, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    qkv_bias = model_type == "qwen2" or cfg.get("attention_bias", False)
    o_bias = model_type != "qwen2" and cfg.get("attention_bias", False)
    mlp_bias = cfg.get("mlp_bias", False)

    def rms(x, w):
        return w * x / math.sqrt(float((x * x).mean()) + eps)

    def linear(x, prefix, bias):
        y = sd[prefix + ".weight"] @ x
        return y + sd[prefix + ".bias"] if bias else y

    def rope(vec, p):
        # Pair (i, i + D/2) rotated by angle p * theta^(-2i/D).
        out = vec.clone()
        for i in range(D // 2):
            angle = p * theta ** (-2.0 * i / D)
            a, b = vec[i], vec[i + D // 2]
            out[i] = a * math.cos(angle) - b * math.sin(angle)
            out[i + D // 2] = b * math.cos(angle) + a * math.sin(angle)
        return out

    xs = [sd["model.embed_tokens.weight"][t].clone() for t in ids]
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        qs, ks, vs = [], [], []
        for x in xs:
            h = rms(x, sd[pre + "input_layernorm.weight"])
            q = linear(h, pre + "self_attn.q_proj", qkv_bias).view(H, D)
            k = linear(h, pre + "self_attn.k_proj", qkv_bias).view(K, D)
            v = linear(h, pre + "self_attn.v_proj", qkv_bias).view(K, D)
            if model_type == "qwen3":
                q = torch.stack([rms(q[j], sd[pre + "self_attn.q_norm.weight"]) for j in range(H)])
                k = torch.stack([rms(k[j], sd[pre + "self_attn.k_norm.weight"]) for j in range(K)])
            p = pos[len(qs)]
            qs.append(torch.stack([rope(q[j], p) for j in range(H)]))
            ks.append(torch.stack([rope(k[j], p) for j in range(K)]))
            vs.append(v)
        new_xs = []
        for t, x in enumerate(xs):
            heads = []
            for j in range(H):
                kv = j // (H // K)
                scores = torch.tensor([float(qs[t][j] @ ks[s][kv]) / math.sqrt(D) for s in range(t + 1)])
                weights = torch.softmax(scores.double(), dim=0)
                heads.append(sum(weights[s] * vs[s][kv] for s in range(t + 1)))
            x = x + linear(torch.cat(heads), pre + "self_attn.o_proj", o_bias)
            h = rms(x, sd[pre + "post_attention_layernorm.weight"])
            gate = linear(h, pre + "mlp.gate_proj", mlp_bias)
            up = linear(h, pre + "mlp.up_proj", mlp_bias)
            silu = gate / (1.0 + torch.exp(-gate))
            new_xs.append(x + linear(silu * up, pre + "mlp.down_proj", mlp_bias))
        xs = new_xs
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return torch.stack([head @ rms(x, sd["model.norm.weight"]) for x in xs])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_matches_independent_reference(model_type):
    model = random_model(model_type)
    cfg = tiny_hf_config(model_type)
    ids = tokens(1, 9, seed=3)
    pos = arange_positions(1, 9, start=5)  # nonzero start: RoPE offsets are exercised
    with torch.no_grad():
        logits, _ = model(ids, pos)
    expected = reference_logits(model.state_dict(), cfg, ids[0].tolist(), pos[0].tolist())
    assert logits.shape == (1, 9, 61)
    assert_close(logits[0].double(), expected, **TOL)


# ---------------------------------------------------------------------------------------------------------
# KV cache and packing.


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_prefill_then_decode_equals_full_forward(model_type):
    model = random_model(model_type)
    ids = tokens(2, 12, seed=1)
    with torch.no_grad():
        full, full_cache = model(ids, arange_positions(2, 12))
        prefill, cache = model(ids[:, :5], arange_positions(2, 5))
        steps = [prefill]
        for t in range(5, 12):
            logits, cache = model(ids[:, t : t + 1], arange_positions(2, 1, start=t), kv_cache=cache)
            steps.append(logits)
    assert_close(torch.cat(steps, dim=1), full, **TOL)
    assert cache.length == 12 == full_cache.length
    for k_cached, k_full in zip(cache.keys, full_cache.keys, strict=True):
        assert_close(k_cached, k_full, **TOL)


def test_chunked_prefill_on_cache_equals_full_forward():
    model = random_model("qwen3")
    ids = tokens(1, 10, seed=2)
    with torch.no_grad():
        full, _ = model(ids, arange_positions(1, 10))
        first, cache = model(ids[:, :4], arange_positions(1, 4))
        second, cache2 = model(ids[:, 4:], arange_positions(1, 6, start=4), kv_cache=cache)
    assert_close(torch.cat([first, second], dim=1), full, **TOL)
    assert cache.length == 4 and cache2.length == 10  # the input cache is not modified


def test_num_logits_to_keep_returns_the_last_tokens():
    model = random_model("llama")
    ids = tokens(2, 6)
    with torch.no_grad():
        full, _ = model(ids, arange_positions(2, 6))
        last, _ = model(ids, arange_positions(2, 6), num_logits_to_keep=1)
    assert_close(last, full[:, -1:], **TOL)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_rows_with_position_resets_equal_separate_forwards(model_type):
    model = random_model(model_type)
    lengths = [4, 7, 3]
    seqs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed_ids = torch.cat(seqs, dim=1)
    positions = torch.cat([arange_positions(1, n) for n in lengths], dim=1)
    mask = block_causal_mask(segments_from_positions(positions))
    with torch.no_grad():
        packed, _ = model(packed_ids, positions, attention_mask=mask)
        separate = torch.cat([model(s, arange_positions(1, s.shape[1]))[0] for s in seqs], dim=1)
    assert_close(packed, separate, **TOL)


def test_block_causal_mask_by_hand():
    segments = torch.tensor([[0, 0, 1, 1, 1]])
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(block_causal_mask(segments)[0], expected)
    assert segments_from_positions(torch.tensor([[0, 1, 0, 1, 2]])).tolist() == [[1, 1, 2, 2, 2]]


def test_batch_rows_are_independent():
    model = random_model("qwen2")
    ids = tokens(3, 8, seed=4)
    with torch.no_grad():
        batched, _ = model(ids, arange_positions(3, 8))
        rows = torch.cat([model(ids[i : i + 1], arange_positions(1, 8))[0] for i in range(3)])
    assert_close(batched, rows, **TOL)


# ---------------------------------------------------------------------------------------------------------
# Save / load.


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_save_load_round_trip_gives_identical_logits(model_type, tmp_path):
    model = random_model(model_type)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    assert loaded.config == model.config
    ids = tokens(2, 7)
    with torch.no_grad():
        assert torch.equal(model(ids, arange_positions(2, 7))[0], loaded(ids, arange_positions(2, 7))[0])
    names = set(loaded.state_dict())
    assert ("lm_head.weight" in names) == (not model.config.tie_word_embeddings)
    if model_type == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in names and "model.layers.0.self_attn.o_proj.bias" not in names
    if model_type == "qwen3":
        assert "model.layers.1.self_attn.q_norm.weight" in names


def test_sharded_checkpoint_round_trip(tmp_path):
    model = random_model("qwen3")
    files = save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and len(files) == len(shards) + 2
    assert set(index["weight_map"]) == set(model.state_dict())
    loaded = load_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_load_casts_dtype(tmp_path):
    save_pretrained(random_model("llama"), tmp_path)
    loaded = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    logits, cache = loaded(tokens(1, 4), arange_positions(1, 4))
    assert logits.dtype == torch.bfloat16 and cache.keys[0].dtype == torch.bfloat16


def test_load_is_strict_about_names(tmp_path):
    from safetensors.torch import load_file, save_file

    save_pretrained(random_model("llama"), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.9.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*unexpected"):
        load_pretrained(tmp_path)


def test_load_rejects_wrong_shapes_and_tolerates_old_buffers(tmp_path):
    from safetensors.torch import load_file, save_file

    save_pretrained(random_model("qwen2"), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(6)  # ignored, as in transformers
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # tied and equal: accepted
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    load_pretrained(tmp_path)
    state["model.norm.weight"] = torch.ones(31)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"wrong shape \['model.norm.weight: file \(31,\) vs config \(32,\)'\]"):
        load_pretrained(tmp_path)


def test_load_rejects_a_tied_checkpoint_with_a_different_lm_head(tmp_path):
    from safetensors.torch import load_file, save_file

    save_pretrained(random_model("qwen2"), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["lm_head.weight"] = torch.zeros_like(state["model.embed_tokens.weight"])
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tie_word_embeddings=true but lm_head\.weight differs"):
        load_pretrained(tmp_path)


def test_load_without_files_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama")))
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        load_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Config parsing.


def test_config_defaults_follow_transformers():
    minimal = {k: v for k, v in tiny_hf_config("qwen3").items() if k not in ("head_dim", "num_key_value_heads")}
    config = DecoderConfig.from_hf(minimal)
    assert config.head_dim == 128 and config.num_key_value_heads == 4 and config.qk_norm
    qwen2 = DecoderConfig.from_hf({k: v for k, v in tiny_hf_config("qwen2").items() if k != "head_dim"})
    assert qwen2.head_dim == 8 and qwen2.attention_qkv_bias and not qwen2.attention_out_bias
    llama = DecoderConfig.from_hf({**tiny_hf_config("llama"), "attention_bias": False, "mlp_bias": False})
    assert not (llama.attention_qkv_bias or llama.attention_out_bias or llama.mlp_bias or llama.qk_norm)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_config_round_trips_through_hf_dict(model_type):
    config = DecoderConfig.from_hf(tiny_hf_config(model_type))
    assert DecoderConfig.from_hf(config.to_hf()) == config


def test_transformers5_rope_parameters_are_read():
    config = {k: v for k, v in tiny_hf_config("qwen2").items() if k != "rope_theta"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    assert DecoderConfig.from_hf(config).rope_theta == 1234.0


def test_linear_rope_scaling_divides_positions():
    scaled = random_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    plain = random_model("llama")
    ids = tokens(1, 6)
    with torch.no_grad():
        a, _ = scaled(ids, torch.arange(0, 12, 2)[None])
        b, _ = plain(ids, torch.arange(0, 6)[None])
    assert_close(a, b, **TOL)


def test_llama3_rope_scaling_frequencies_by_hand():
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = DecoderConfig.from_hf(tiny_hf_config("llama", rope_scaling=rope, rope_theta=10000.0))
    got = rope_inv_freq(config).double()
    for i, f in enumerate(10000.0 ** (-torch.arange(0, 12, 2).double() / 12)):
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4:  # high frequency: unchanged
            want = f
        elif wavelen > 64 / 1:  # low frequency: divided by factor
            want = f / 8
        else:
            smooth = (64 / wavelen - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert abs(float(got[i]) - float(want)) <= 1e-6 * float(want), i


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"model_type": "mixtral"}, "mixture-of-experts"),
        ({"num_experts": 8}, "num_experts=8"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=True"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling type 'longrope'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5}}, r"rope_scaling\.factor=0\.5"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}}, r"rope_scaling\.beta_fast=-1"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}}, r"rope_scaling\.truncate='no'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs fields"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"head_dim": 7}, "head_dim=7"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
    ],
)
def test_config_errors_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig.from_hf({**tiny_hf_config("qwen2"), **overrides})


def test_forward_rejects_bad_shapes():
    model = random_model("qwen3")
    ids = tokens(2, 5)
    with pytest.raises(ValueError, match="positions_BT"):
        model(ids, arange_positions(2, 4))
    with pytest.raises(ValueError, match="input_ids_BT"):
        model(ids[0], arange_positions(1, 5)[0])
    with pytest.raises(ValueError, match=r"attention_mask must be bool \[B, T, S_past \+ T\] = \[2, 5, 5\]"):
        model(ids, arange_positions(2, 5), attention_mask=torch.ones(2, 5, 4, dtype=torch.bool))
    _, cache = model(ids, arange_positions(2, 5))
    with pytest.raises(ValueError, match="kv_cache holds 2 rows"):
        model(ids[:1, :1], arange_positions(1, 1, start=5), kv_cache=cache)


# ---------------------------------------------------------------------------------------------------------
# Parity with transformers (only where it imports) and CUDA (only where present).


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# Qwen3's long-context setting (factor 4 over the original length), at a length the test's positions pass.
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("llama", {"rope_scaling": LLAMA3_ROPE, "attention_bias": False, "mlp_bias": False}),
        ("qwen3", {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen3", {"rope_scaling": YARN_ROPE, "max_position_embeddings": 64}),
        ("qwen2", {"rope_scaling": {**YARN_ROPE, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}}),
        ("qwen3", {"rope_scaling": {**YARN_ROPE, "attention_factor": 1.3}}),
        ("qwen3", {"rope_scaling": {**YARN_ROPE, "mscale": 0.707, "mscale_all_dim": 1.0}}),
    ],
)
def test_parity_with_transformers(model_type, overrides, tmp_path):
    """Same weights in transformers give the same logits, and a checkpoint transformers saves loads back."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the dev extra) is not installed; parity test not run"
    )
    model = random_model(model_type, **overrides)
    save_pretrained(model, tmp_path / "ours")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = tokens(2, 10, seed=7)
    pos = arange_positions(2, 10, start=20)  # past original_max_position_embeddings of the llama3 case
    with torch.no_grad():
        ours, _ = model(ids, pos)
        theirs = hf_model(input_ids=ids, position_ids=pos).logits
    assert_close(ours, theirs.float(), **TOL)
    hf_model.save_pretrained(str(tmp_path / "theirs"))  # transformers' own config.json and tensor names
    reloaded = load_pretrained(tmp_path / "theirs")
    assert reloaded.config == model.config
    with torch.no_grad():
        assert_close(reloaded(ids, pos)[0], ours, **TOL)
