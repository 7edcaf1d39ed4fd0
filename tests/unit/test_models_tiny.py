"""The tiny default model (gyre.models.tiny) and its CLI (python -m gyre.models build-tiny).

Covers: the HF layout and the token ids in config.json, loading with the engine's `load_pretrained` and a
forward on a chat-rendered prompt, the parameter count (computed by hand), byte-identical rebuilds in fresh
processes, the cache (reuse, `GYRE_CACHE`, concurrent builders in threads and processes), refusing an out_dir
that holds other files, the spec's validation and the CLI's output and exit codes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gyre.config import TinyModelSpec
from gyre.models import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    build_tiny_model,
    count_parameters,
    load_tokenizer,
    render_chat,
    tiny_model_dir,
)
from gyre.models import tiny as tiny_module
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import MODEL_FILES

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_TIME_LIMIT_S = 10.0  # measured ~1.0 s on 2 CPU cores, torch import included
# Hand count for the default spec with the 512-token vocabulary (qwen3, tied, GQA 4 query / 2 KV heads of 48):
#   embedding 512 * 192                               =    98,304
#   per layer: q 192*192 + k 192*96 + v 192*96 + o 192*192 = 110,592; q/k norm 2 * 48 = 96;
#              SwiGLU 3 * 192 * 512 = 294,912; two RMSNorms 2 * 192 = 384      -> 405,984 x 4 = 1,623,936
#   final norm 192                                    =       192
EXPECTED_PARAMS = 98_304 + 4 * (110_592 + 96 + 294_912 + 384) + 192  # 1,722,432

CONVERSATION = [
    {"role": "system", "content": "You are a calculator agent."},
    {"role": "user", "content": "What is 17 * 23?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "calculator", "arguments": {"expression": "17 * 23"}}],
    },
    {"role": "tool", "content": "391"},
]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    start = time.perf_counter()
    build_tiny_model(out)
    return out, time.perf_counter() - start


def test_build_writes_one_hf_directory_with_the_tokenizer_ids(built):
    out, seconds = built
    print(f"build_tiny_model() took {seconds:.3f} s")
    assert seconds < BUILD_TIME_LIMIT_S
    assert sorted(p.name for p in out.iterdir()) == sorted(MODEL_FILES)
    config = json.loads((out / "config.json").read_text())
    tok = load_tokenizer(out)
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) == 512
    assert config["bos_token_id"] == tok.token_to_id(BOS_TOKEN) == 0
    assert config["eos_token_id"] == tok.token_to_id(EOS_TOKEN) == 2
    assert config["pad_token_id"] == tok.token_to_id(PAD_TOKEN) == 9
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (192, 4, 512)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 48)
    assert (config["rope_theta"], config["max_position_embeddings"]) == (10000.0, 4096)


def test_load_pretrained_runs_a_chat_prompt(built):
    out, _ = built
    model = load_pretrained(out)
    tok = load_tokenizer(out)
    text = render_chat(CONVERSATION, add_generation_prompt=True)
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Turns: system, user, assistant (tool call), tool result (a user turn), generation prompt.
    assert ids.count(tok.token_to_id("<|im_start|>")) == 5
    assert tok.token_to_id('{"name": "') in ids and tok.token_to_id("<tool_response>") in ids
    T = len(ids)
    input_ids_BT = torch.tensor([ids])
    with torch.no_grad():
        logits_BTV, cache = model(input_ids_BT, torch.arange(T)[None])
        # One decode step from the cache gives the logits a full forward gives for the same token.
        next_B1 = logits_BTV[:, -1:].argmax(-1)
        step_B1V, _ = model(next_B1, torch.tensor([[T]]), kv_cache=cache)
        full_BTV, _ = model(torch.cat([input_ids_BT, next_B1], 1), torch.arange(T + 1)[None])
    assert logits_BTV.shape == (1, T, 512)
    assert logits_BTV.dtype == torch.float32 and torch.isfinite(logits_BTV).all()
    assert cache.length == T and cache.keys[0].shape == (1, 2, T, 48) and len(cache.keys) == 4
    torch.testing.assert_close(step_B1V[0, -1], full_BTV[0, -1], atol=1e-5, rtol=0)
    # Random init at std 0.02: the next-token distribution is close to uniform over the vocabulary.
    entropy = -(logits_BTV[0, -1].log_softmax(-1).exp() * logits_BTV[0, -1].log_softmax(-1)).sum()
    assert entropy > 0.95 * torch.log(torch.tensor(512.0))


def test_parameter_count_matches_the_hand_count(built):
    out, _ = built
    model = load_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMS == 1_722_432
    assert count_parameters(out) == EXPECTED_PARAMS  # tied: no lm_head tensor in the file
    assert (out / "model.safetensors").stat().st_size < EXPECTED_PARAMS * 4 + 64 * 1024  # fp32 + a small header


def test_seed_changes_the_weights_only(built, tmp_path):
    out, _ = built
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    a, b = _files(out), _files(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in b.items() if k != "model.safetensors"
    }


def test_rebuild_in_fresh_processes_is_byte_identical(built, tmp_path):
    code = "import sys; from gyre.models import build_tiny_model; build_tiny_model(sys.argv[1])"
    outs = []
    for k, hash_seed in enumerate(("1", "12345")):
        out = tmp_path / f"p{k}"
        env = {**_env(), "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, timeout=120)
        outs.append(_files(out))
    assert outs[0] == outs[1] == _files(built[0])


def test_rebuild_over_an_earlier_build_is_allowed(built, tmp_path):
    out = build_tiny_model(tmp_path / "m")
    assert _files(build_tiny_model(out)) == _files(built[0])


def test_out_dir_with_other_files_is_refused_and_left_alone(tmp_path):
    shard = tmp_path / "model-00001-of-00002.safetensors"  # save_pretrained would delete it
    shard.write_bytes(b"not ours")
    with pytest.raises(ValueError, match="holds files a tiny-model build does not write"):
        build_tiny_model(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [shard.name] and shard.read_bytes() == b"not ours"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        build_tiny_model(a_file)
    with pytest.raises(ValueError, match="cannot be created"):
        build_tiny_model(a_file / "sub")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hidden_size": 190}, "hidden_size"),  # not a multiple of 4 heads
        ({"hidden_size": 4 * 7}, "hidden_size"),  # odd head_dim
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"model_type": "mistral"}, "model_type"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"vocab_size": True}, "vocab_size"),
    ],
)
def test_spec_rejects_bad_fields_by_name(kwargs, field):
    with pytest.raises(ValueError, match=rf"TinyModelSpec\.{field}="):
        TinyModelSpec(**kwargs)


def test_a_qwen2_spec_builds_and_loads(tmp_path):
    spec = TinyModelSpec(model_type="qwen2", num_hidden_layers=1, vocab_size=300)
    out = build_tiny_model(tmp_path / "q2", spec=spec)
    model = load_pretrained(out)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == 300
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_cache_builds_once_and_reuses(tmp_path, monkeypatch):
    first = tiny_model_dir(tmp_path)
    assert re.fullmatch(r"tiny-[0-9a-f]{16}", first.name) and first.parent == tmp_path
    assert load_pretrained(first).config.vocab_size == 512

    def must_not_build(*args, **kwargs):
        raise AssertionError("a cached model was rebuilt")

    monkeypatch.setattr(tiny_module, "build_tiny_model", must_not_build)
    assert tiny_model_dir(tmp_path) == first
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path))
    assert tiny_model_dir() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no staging leftovers
    # Another seed or spec is another cache entry.
    assert tiny_module.spec_hash(seed=1) != tiny_module.spec_hash()
    assert tiny_module.spec_hash(TinyModelSpec(num_hidden_layers=2)) != tiny_module.spec_hash()


def test_concurrent_threads_end_with_one_valid_dir(tmp_path, monkeypatch):
    """Both threads build (a barrier holds each finished build until the other is done); one rename wins."""
    real_build = tiny_module.build_tiny_model
    barrier = threading.Barrier(2, timeout=60)
    builds = []

    def build_then_wait(out_dir, spec=None, seed=0):
        path = real_build(out_dir, spec=spec, seed=seed)
        builds.append(path)
        barrier.wait()
        return path

    monkeypatch.setattr(tiny_module, "build_tiny_model", build_then_wait)
    results, errors = [], []

    def worker():
        try:
            results.append(tiny_model_dir(tmp_path))
        except Exception as err:  # reported below: a thread's exception would otherwise be lost
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(builds) == 2 and len(results) == 2 and results[0] == results[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [results[0].name]
    assert sorted(p.name for p in results[0].iterdir()) == sorted(MODEL_FILES)
    load_pretrained(results[0])


def test_concurrent_processes_end_with_one_valid_dir(built, tmp_path):
    code = "from gyre.models import tiny_model_dir; print(tiny_model_dir())"
    env = {**_env(), "GYRE_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    paths = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        paths.append(stdout.strip())
    assert len(set(paths)) == 1
    (entry,) = tmp_path.iterdir()
    assert str(entry) == paths[0]
    assert _files(entry) == _files(built[0])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gyre.models", *args], env=_env(), capture_output=True, text=True, timeout=120
    )


def test_cli_builds_and_prints_path_and_summary(tmp_path):
    result = _cli("build-tiny", str(tmp_path / "cli"), "--seed", "3")
    assert result.returncode == 0, result.stderr
    path_line, summary_line = result.stdout.splitlines()
    assert Path(path_line) == (tmp_path / "cli").resolve()
    summary = json.loads(summary_line)
    assert summary["params"] == EXPECTED_PARAMS and summary["vocab"] == 512 and summary["seed"] == 3
    assert summary["files"] == sorted(MODEL_FILES)
    assert 0 < summary["build_seconds"] < BUILD_TIME_LIMIT_S
    load_pretrained(path_line)


@pytest.mark.parametrize("make_bad", ["file", "foreign", "under_a_file"])
def test_cli_bad_out_dir_is_one_line_and_exit_2(tmp_path, make_bad):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("keep me")
    target = {"file": tmp_path / "file", "foreign": tmp_path / "dir", "under_a_file": tmp_path / "file" / "m"}
    result = _cli("build-tiny", str(target[make_bad]))
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("build-tiny: error: ")
    assert (tmp_path / "dir" / "notes.txt").read_text() == "keep me"


def test_cli_usage_errors_exit_2(tmp_path):
    assert _cli("build-tiny").returncode == 2  # missing OUT_DIR
    assert _cli("build-tiny", str(tmp_path / "m"), "--seed", "x").returncode == 2
    assert _cli("no-such-command").returncode == 2
    negative = _cli("build-tiny", str(tmp_path / "m"), "--seed", "-1")
    assert negative.returncode == 2 and "seed=-1" in negative.stderr


def test_importing_gyre_models_imports_no_torch():
    code = "import sys, gyre.models; print([m for m in ('torch', 'tokenizers', 'jinja2') if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_load_pretrained_does_not_import_torch_dynamo(built):
    """Loading a checkpoint builds the model on the meta device; an initializer that runs through torch's Python
    refs there imports torch._dynamo (~1 s of every gyre.serve start-up; docs/dependencies.md)."""
    out, _ = built
    code = (
        "import sys\n"
        "from gyre.models.hf_weights import load_pretrained\n"
        f"load_pretrained({str(out)!r})\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False"


def test_transformers_loads_it_with_equal_logits(built):
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the dev extra) is not installed; cross-check not run"
    )
    out, _ = built
    ours = load_pretrained(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert theirs.config.pad_token_id == 9 and theirs.config.eos_token_id == 2
    ids = load_tokenizer(out).encode(render_chat(CONVERSATION)).ids
    with torch.no_grad():
        ours_BTV, _ = ours(torch.tensor([ids]), torch.arange(len(ids))[None])
        theirs_BTV = theirs(input_ids=torch.tensor([ids])).logits
    torch.testing.assert_close(ours_BTV, theirs_BTV.float(), atol=1e-5, rtol=0)
