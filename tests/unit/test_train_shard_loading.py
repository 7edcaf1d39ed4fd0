"""gyre.trainer.shard_loading: a rank's Megatron shard read straight from safetensors slices equals `hf_to_megatron`
of the whole checkpoint, at every TP x PP rank, from one file or several, in the file's dtype; bad checkpoints are
refused before any parameter is written; a model filled this way gives the same log-probs as one loaded whole."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from test_train_convert import CONFIG, LAYOUTS, hf_state

from gyre.models.decoder import DecoderLM
from gyre.models.hf_weights import read_state_dict, save_pretrained
from gyre.trainer.convert import chunk_bounds, hf_to_megatron, load_hf_state_dict
from gyre.trainer.model import build_gpt_model
from gyre.trainer.shard_loading import load_hf_checkpoint, read_megatron_shard

# Layouts a config.json can state: Qwen3 has one attention_bias for q/k/v and o_proj (gyre.trainer refuses an o_proj
# bias), so its biases are off; Qwen2 carries the q/k/v biases.
QWEN3 = dataclasses.replace(CONFIG, attention_qkv_bias=False)
QWEN2 = dataclasses.replace(CONFIG, model_type="qwen2", qk_norm=False)


def save_checkpoint(path, config, state, *, max_shard_bytes=None):
    with torch.device("meta"):
        model = DecoderLM(config)
    model.load_state_dict(state, assign=True)
    save_pretrained(model, path, max_shard_bytes=max_shard_bytes)
    return path


@pytest.mark.parametrize("variant", ["qwen3-untied", "qwen2-tied", "llama-sharded-bf16"])
def test_every_ranks_shard_equals_the_whole_conversion(tmp_path, variant):
    config = {"qwen3": QWEN3, "qwen2": QWEN2, "llama": dataclasses.replace(QWEN3, model_type="llama", qk_norm=False)}[
        variant.split("-")[0]
    ]
    config = dataclasses.replace(config, tie_word_embeddings="tied" in variant)
    state = hf_state(config)
    if variant.endswith("bf16"):
        state = {name: t.to(torch.bfloat16) for name, t in state.items()}
    # Several files with an index for the sharded variant (a tensor per file or so); one file otherwise.
    path = save_checkpoint(tmp_path, config, state, max_shard_bytes=4096 if "sharded" in variant else None)
    whole = read_state_dict(path, dtype=next(iter(state.values())).dtype, device="cpu")
    for tp, pp in LAYOUTS:
        for tp_rank in range(tp):
            for pp_rank in range(pp):
                ranks = {"tp_rank": tp_rank, "tp_size": tp, "pp_rank": pp_rank, "pp_size": pp}
                want = hf_to_megatron(whole, config, **ranks)
                got = read_megatron_shard(path, config, **ranks)
                assert sorted(got) == sorted(want), ranks
                for name in want:
                    assert got[name].dtype == want[name].dtype, (ranks, name)
                    assert torch.equal(got[name], want[name]), (ranks, name)


def test_chunk_bounds_are_torch_chunk():
    for size in range(1, 13):
        for parts in range(1, 5):
            pieces = torch.arange(size).chunk(parts)
            for index in range(parts):
                start, stop = chunk_bounds(size, parts, index)
                want = pieces[index].tolist() if index < len(pieces) else []
                assert list(range(start, stop)) == want, (size, parts, index)


def broken(tmp_path, config, kind):
    state = hf_state(config)
    if kind == "missing":
        del state["model.layers.1.mlp.up_proj.weight"]
    elif kind == "wrong shape":
        state["model.norm.weight"] = torch.ones(7)
    elif kind == "unexpected":
        state["model.layers.0.mlp.extra.weight"] = torch.ones(2)
    elif kind == "tied lm_head differs":
        state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    save_file({name: t.contiguous() for name, t in state.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("missing", r"missing \['model\.layers\.1\.mlp\.up_proj\.weight'\]"),
        ("wrong shape", r"model\.norm\.weight: file \(7,\) vs config \(32,\)"),
        ("unexpected", r"unexpected \['model\.layers\.0\.mlp\.extra\.weight'\]"),
        ("tied lm_head differs", r"lm_head\.weight differs from model\.embed_tokens\.weight"),
    ],
)
def test_bad_checkpoints_are_refused_before_a_parameter_is_written(model_parallel, tmp_path, kind, match):
    config = dataclasses.replace(QWEN3, tie_word_embeddings=kind == "tied lm_head differs")
    path = broken(tmp_path / "ckpt", config, kind)
    with pytest.raises(ValueError, match=match):
        read_megatron_shard(path, config, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)
    model = build_gpt_model(config)
    before = {name: t.clone() for name, t in model.state_dict().items() if not name.endswith("_extra_state")}
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(model, path, config)
    for name, tensor in before.items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_tied_checkpoint_with_its_lm_head_equal_loads(tmp_path):
    config = dataclasses.replace(QWEN2, tie_word_embeddings=True)
    state = hf_state(config)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config.to_hf()))
    save_file(state, str(path / "model.safetensors"))
    shard = read_megatron_shard(path, config, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    assert "output_layer.weight" not in shard


def test_a_model_filled_from_slices_equals_one_loaded_whole(model_parallel, tmp_path):
    """In the model's dtype, uninitialized first (as the runtime builds it): every parameter is written."""
    state = hf_state(QWEN2)
    path = save_checkpoint(tmp_path, QWEN2, {name: t.to(torch.bfloat16) for name, t in state.items()})
    sliced = build_gpt_model(QWEN2, perform_initialization=False)
    load_hf_checkpoint(sliced, path, QWEN2)
    whole = build_gpt_model(QWEN2)
    load_hf_state_dict(whole, read_state_dict(path, dtype=torch.float32, device="cpu"), QWEN2)
    for (name, a), (_, b) in zip(sliced.state_dict().items(), whole.state_dict().items(), strict=True):
        if not name.endswith("_extra_state"):
            assert a.dtype == torch.float32 and torch.equal(a, b), name
