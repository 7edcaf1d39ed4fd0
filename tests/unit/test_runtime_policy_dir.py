"""The run's policy directory (`gyre.runtime.job.policy_dir`): versions written in parts by several writers and
finished by one, loaded bit for bit by `load_pretrained` and by transformers through the `policy` link; the newest
`keep` versions kept; a writer SIGKILLed mid-write or between the rename and the link's swap; a full disk; a run
directory of the earlier layout (`policy/` a directory) taken over."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import gyre.models.hf_weights as hf_weights
from gyre.models import DecoderConfig, DecoderLM, load_pretrained, save_pretrained
from gyre.runtime.job.policy_dir import (
    discard_policy,
    finish_policy,
    stage_policy,
    write_policy,
    write_policy_part,
)

CONFIG = DecoderConfig.from_hf(
    {
        "model_type": "qwen3",
        "vocab_size": 61,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "rope_theta": 500.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
)


def model_of(seed: int) -> DecoderLM:
    """A Qwen3-shaped model with every parameter random (norms around 1), different for each seed."""
    generator = torch.Generator().manual_seed(seed)
    model = DecoderLM(CONFIG)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.3 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model.eval()


def source_of(run_dir: Path) -> Path:
    """A starting checkpoint's side files: a tokenizer, and a config.json with a key the model's config lacks and
    transformers 5's `dtype` (which the policy's `torch_dtype` overrides)."""
    source = run_dir.parent / "source"
    source.mkdir(exist_ok=True)
    (source / "tokenizer.json").write_text("{}")
    (source / "config.json").write_text(json.dumps({"pad_token_id": 7, "dtype": "float32"}))
    return source


def state_in(model: DecoderLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(dtype) for name, t in model.state_dict().items()}


def assert_policy(run_dir: Path, version: int, state: dict[str, torch.Tensor]) -> None:
    """`policy` links to `policies/v<version>`, which loads as `state` bit for bit."""
    assert os.readlink(run_dir / "policy") == f"policies/v{version}"
    assert json.loads((run_dir / "policy" / "policy.json").read_text())["version"] == version
    dtype = next(iter(state.values())).dtype
    loaded = load_pretrained(run_dir / "policy", dtype=dtype).state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)


def versions(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "policies").iterdir())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_parts_of_two_writers_make_a_policy_that_loads_bit_for_bit(tmp_path, dtype):
    run_dir = tmp_path / "run"
    state = state_in(model_of(1), dtype)
    names = sorted(state)
    staging = stage_policy(run_dir, 1)
    # Writer 0 hands over half the tensors in one part, writer 1 the rest in two, at the same time; one tensor is
    # non-contiguous, two are views of one stacked tensor (they share memory, which safetensors refuses).
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    stacked = torch.cat([state[q], state[k]])
    bucket_c = {q: stacked[: len(state[q])], k: stacked[len(state[q]) :]}
    rest = [name for name in names if name not in bucket_c]
    bucket_a = {name: state[name] for name in rest[: len(rest) // 2]}
    bucket_a["lm_head.weight"] = state["lm_head.weight"].t().contiguous().t()
    assert not bucket_a["lm_head.weight"].is_contiguous()
    bucket_b = {name: state[name] for name in rest[len(rest) // 2 :]}
    with ThreadPoolExecutor(2) as pool:
        maps = list(
            pool.map(
                lambda job: write_policy_part(staging, job[0], writer=job[1], index=job[2]),
                [(bucket_a, 0, 0), (bucket_b, 1, 0), (bucket_c, 1, 1)],
            )
        )
    assert maps[2] == {q: "model-w001-00001.safetensors", k: "model-w001-00001.safetensors"}
    weight_map = {name: file for part in maps for name, file in part.items()}
    target = finish_policy(
        staging, weight_map=weight_map, config=CONFIG, dtype=dtype, source_dir=source_of(run_dir), version=1, keep=2
    )
    assert target == run_dir / "policies" / "v1"
    assert_policy(run_dir, 1, state)
    config = json.loads((target / "config.json").read_text())
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.") and "dtype" not in config
    assert config["pad_token_id"] == 7  # the source's key
    assert (target / "tokenizer.json").is_file()
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert sorted(p.name for p in target.glob("*.safetensors")) == [
        "model-w000-00000.safetensors",
        "model-w001-00000.safetensors",
        "model-w001-00001.safetensors",
    ]
    assert versions(run_dir) == ["v1"]


def test_transformers_loads_the_policy_and_computes_what_gyre_does(tmp_path):
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the dev extra) is not installed; the policy's transformers load not run"
    )
    run_dir = tmp_path / "run"
    write_policy(model_of(2), source_dir=source_of(run_dir), run_dir=run_dir, version=3, dtype=torch.bfloat16)
    ours = load_pretrained(run_dir / "policy")  # bf16 on disk, both read into fp32
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(run_dir / "policy"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        logits, _ = ours(ids, positions)
        expected = theirs(input_ids=ids, position_ids=positions).logits
    assert logits.abs().max() > 1.0  # weights big enough that a wrong tensor shows
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0.0)


def test_the_newest_keep_versions_are_kept_and_policy_links_to_the_last(tmp_path):
    run_dir = tmp_path / "run"
    source = source_of(run_dir)
    for version in (1, 2, 3, 4):
        write_policy(model_of(version), source_dir=source, run_dir=run_dir, version=version, keep=2)
    assert versions(run_dir) == ["v3", "v4"]
    assert_policy(run_dir, 4, state_in(model_of(4), torch.float32))
    assert sorted(p.name for p in run_dir.iterdir()) == ["policies", "policy"]


def test_a_version_again_replaces_it_and_versions_above_the_finished_one_stay(tmp_path):
    """A resumed run writes its checkpoint's version (below the latest), then that later version again."""
    run_dir = tmp_path / "run"
    source = source_of(run_dir)
    for version in (1, 2):
        write_policy(model_of(version), source_dir=source, run_dir=run_dir, version=version, keep=1)
    assert versions(run_dir) == ["v2"]
    write_policy(model_of(11), source_dir=source, run_dir=run_dir, version=1, keep=1)
    assert versions(run_dir) == ["v1", "v2"]  # v2 is above: left for the run to write again
    assert_policy(run_dir, 1, state_in(model_of(11), torch.float32))
    write_policy(model_of(12), source_dir=source, run_dir=run_dir, version=2, keep=1)
    assert versions(run_dir) == ["v2"]
    assert_policy(run_dir, 2, state_in(model_of(12), torch.float32))
    write_policy(model_of(13), source_dir=source, run_dir=run_dir, version=2, keep=1)  # the linked version again
    assert_policy(run_dir, 2, state_in(model_of(13), torch.float32))


KILLED_MID_WRITE = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_runtime_policy_dir import model_of
from gyre.runtime.job.policy_dir import stage_policy, write_policy_part
run_dir = Path({run_dir!r})
state = model_of(2).state_dict()
names = sorted(state)
staging = stage_policy(run_dir, 2)
for index in range(3):
    write_policy_part(staging, {{n: state[n] for n in names[index::3]}}, writer=0, index=index)
    (run_dir / "parts-written").write_text(str(index + 1))
    time.sleep(60)  # the test kills the writer here, after its first part
"""


def test_a_writer_killed_mid_write_leaves_the_previous_policy_and_the_next_finish_cleans_up(tmp_path):
    run_dir = tmp_path / "run"
    source = source_of(run_dir)
    write_policy(model_of(1), source_dir=source, run_dir=run_dir, version=1)
    code = KILLED_MID_WRITE.format(tests=str(Path(__file__).parent), run_dir=str(run_dir))
    writer = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "parts-written").exists():
            assert writer.poll() is None, writer.stderr.read()
            assert time.monotonic() < deadline, "the writer wrote no part in 120 s"
            time.sleep(0.05)
        os.kill(writer.pid, signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(timeout=30)
    assert (run_dir / "parts-written").read_text() == "1"
    assert sorted(p.name for p in (run_dir / "policies" / ".v2.tmp").iterdir()) == ["model-w000-00000.safetensors"]
    assert_policy(run_dir, 1, state_in(model_of(1), torch.float32))
    write_policy(model_of(3), source_dir=source, run_dir=run_dir, version=3)
    assert versions(run_dir) == ["v1", "v3"]
    assert_policy(run_dir, 3, state_in(model_of(3), torch.float32))


KILLED_BEFORE_THE_SWAP = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_runtime_policy_dir import model_of
import gyre.runtime.job.policy_dir as policy_dir
def killed(run_dir, version):  # the writer dies once policies/v2 is renamed into place, before `policy` links to it
    os.kill(os.getpid(), signal.SIGKILL)
policy_dir._point_policy_at = killed
policy_dir.write_policy(model_of(2), source_dir=Path({source!r}), run_dir=Path({run_dir!r}), version=2)
"""


def test_a_writer_killed_between_the_rename_and_the_swap_leaves_the_previous_policy_linked(tmp_path):
    run_dir = tmp_path / "run"
    source = source_of(run_dir)
    write_policy(model_of(1), source_dir=source, run_dir=run_dir, version=1)
    code = KILLED_BEFORE_THE_SWAP.format(tests=str(Path(__file__).parent), run_dir=str(run_dir), source=str(source))
    process = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert process.returncode == -signal.SIGKILL, process.stderr
    assert versions(run_dir) == ["v1", "v2"]
    assert_policy(run_dir, 1, state_in(model_of(1), torch.float32))
    assert json.loads((run_dir / "policies" / "v2" / "policy.json").read_text())["version"] == 2  # complete beside it
    write_policy(model_of(3), source_dir=source, run_dir=run_dir, version=3)
    assert versions(run_dir) == ["v2", "v3"]
    assert_policy(run_dir, 3, state_in(model_of(3), torch.float32))


def test_a_full_disk_raises_and_leaves_the_previous_policy_and_no_staging(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    source = source_of(run_dir)
    write_policy(model_of(1), source_dir=source, run_dir=run_dir, version=1)
    real = hf_weights.save_tensors

    def full(tensors, file):  # a part's bytes half on disk, then the disk is full
        real(tensors, file)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_weights, "save_tensors", full)  # policy_dir imports it when it writes a part
    with pytest.raises(OSError, match="No space left"):
        write_policy(model_of(2), source_dir=source, run_dir=run_dir, version=2)
    assert versions(run_dir) == ["v1"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["policies", "policy"]
    assert_policy(run_dir, 1, state_in(model_of(1), torch.float32))

    staging = stage_policy(run_dir, 2)  # parts written by the caller: the failed part leaves no file of it
    with pytest.raises(OSError, match="No space left"):
        write_policy_part(staging, {"model.norm.weight": torch.ones(32)}, writer=3, index=0)
    assert list(staging.iterdir()) == []
    discard_policy(staging)
    assert versions(run_dir) == ["v1"]


def test_parts_that_do_not_make_the_model_are_refused_and_leave_the_previous_policy(tmp_path):
    run_dir = tmp_path / "run"
    source = source_of(run_dir)
    write_policy(model_of(1), source_dir=source, run_dir=run_dir, version=1)
    state = state_in(model_of(2), torch.float32)
    names = sorted(state)

    def finish(parts: list[dict], dtype=torch.float32, extra_map=None) -> None:
        staging = stage_policy(run_dir, 2)
        weight_map: dict[str, str] = {}
        for index, part in enumerate(parts):
            weight_map |= write_policy_part(staging, part, writer=0, index=index)
        weight_map |= extra_map or {}
        finish_policy(staging, weight_map=weight_map, config=CONFIG, dtype=dtype, source_dir=source, version=2, keep=2)

    with pytest.raises(ValueError, match=r"lacks \['model\.norm\.weight'\]"):
        finish([{n: state[n] for n in names if n != "model.norm.weight"}])
    with pytest.raises(ValueError, match=r"model\.norm\.weight is in two parts"):
        finish([state, {"model.norm.weight": state["model.norm.weight"]}])
    with pytest.raises(ValueError, match="is F32, expected BF16"):
        finish([state], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(31,\), the config's is \(32,\)"):
        finish([{**state, "model.norm.weight": state["model.norm.weight"][:31]}])
    with pytest.raises(ValueError, match="names files that are not in"):
        finish([state], extra_map={"model.norm.weight": "model-w009-00000.safetensors"})
    assert versions(run_dir) == ["v1"]  # each refused staging directory removed
    assert_policy(run_dir, 1, state_in(model_of(1), torch.float32))

    staging = stage_policy(run_dir, 2)
    write_policy_part(staging, state, writer=0, index=0)
    with pytest.raises(ValueError, match="already written"):
        write_policy_part(staging, state, writer=0, index=0)
    with pytest.raises(ValueError, match="has no tensors"):
        write_policy_part(staging, {}, writer=0, index=1)
    with pytest.raises(ValueError, match="not policy 3's staging directory"):
        finish_policy(staging, weight_map={}, config=CONFIG, dtype=torch.float32, source_dir=source, version=3, keep=2)


def earlier_layout(run_dir: Path, version: int | None) -> dict[str, torch.Tensor]:
    """A run directory as the earlier `write_policy` left it: `policy/` a directory (its policy.json says `version`,
    or is absent), a cut-off write's `.policy-<v>.tmp/` and a cut-off swap's `.policy-previous/`; the state of
    `policy/`."""
    model = model_of(7)
    save_pretrained(model, run_dir / "policy")
    if version is not None:
        (run_dir / "policy" / "policy.json").write_text(json.dumps({"version": version, "source": "x"}) + "\n")
    for stale in (".policy-5.tmp", ".policy-previous"):
        (run_dir / stale).mkdir()
        (run_dir / stale / "config.json").write_text("{}")
    return state_in(model, torch.float32)


@pytest.mark.parametrize(("earlier_version", "kept"), [(1, ["v1", "v2"]), (2, ["v2"]), (None, ["v2"])])
def test_a_run_directory_of_the_earlier_layout_is_taken_over_by_the_first_finish(tmp_path, earlier_version, kept):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = earlier_layout(run_dir, earlier_version)
    write_policy(model_of(2), source_dir=source_of(run_dir), run_dir=run_dir, version=2)
    assert sorted(p.name for p in run_dir.iterdir()) == ["policies", "policy"]
    assert versions(run_dir) == kept
    assert_policy(run_dir, 2, state_in(model_of(2), torch.float32))
    if "v1" in kept:  # the earlier policy/ became version 1, loadable as it was
        loaded = load_pretrained(run_dir / "policies" / "v1").state_dict()
        assert all(torch.equal(loaded[name], earlier[name]) for name in earlier)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a part of GPU tensors not written")
def test_a_part_of_gpu_tensors_is_written_from_the_cpu(tmp_path):
    run_dir = tmp_path / "run"
    state = state_in(model_of(1), torch.bfloat16)
    staging = stage_policy(run_dir, 1)
    weight_map = write_policy_part(staging, {n: t.cuda() for n, t in state.items()}, writer=0, index=0)
    finish_policy(
        staging,
        weight_map=weight_map,
        config=CONFIG,
        dtype=torch.bfloat16,
        source_dir=source_of(run_dir),
        version=1,
        keep=1,
    )
    assert_policy(run_dir, 1, state)
