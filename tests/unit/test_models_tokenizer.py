"""The tiny tokenizer (gyre.models.tokenizer) and chat template (gyre.models.chat_template).

Covers: lossless round trip, one token per digit, special and tool-call tokens as single ids, the vocabulary
size, byte-identical rebuilds in fresh processes, the build time, each role of the chat template by its
exact expected string, and the Python renderer equal to the Jinja template on many generated conversations.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.models import (
    CHAT_TEMPLATE,
    DEFAULT_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TOOL_CALL_TOKENS,
    build_tokenizer,
    load_tokenizer,
    render_chat,
    render_chat_jinja,
    train_tokenizer,
)

BUILD_TIME_LIMIT_S = 5.0
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    start = time.perf_counter()
    build_tokenizer(out)
    return out, time.perf_counter() - start


@pytest.fixture(scope="module")
def tok(built):
    return load_tokenizer(built[0])


def test_build_is_fast_and_writes_hf_layout(built):
    out, seconds = built
    print(f"build_tokenizer(vocab_size={DEFAULT_VOCAB_SIZE}) took {seconds:.3f} s")
    assert seconds < BUILD_TIME_LIMIT_S
    assert all((out / name).is_file() for name in FILES)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|endoftext|>", "<|im_end|>", "<|pad|>")
    special_map = json.loads((out / "special_tokens_map.json").read_text())
    assert special_map["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("vocab_size", [300, DEFAULT_VOCAB_SIZE, 2048])
def test_vocab_size_is_respected(vocab_size):
    tokenizer = train_tokenizer(vocab_size)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    assert max(tokenizer.get_vocab(with_added_tokens=True).values()) == vocab_size - 1


@pytest.mark.parametrize("vocab_size", [0, 267, 512.0, "512"])
def test_too_small_or_non_int_vocab_size_is_rejected(vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(vocab_size)


def test_special_tokens_are_single_ids_in_order(tok):
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == expected_id
        assert tok.encode(token).ids == [expected_id]
        assert tok.encode(f"a{token}b").ids[1] == expected_id
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_tool_call_json_parts_are_single_tokens(tok):
    for token in TOOL_CALL_TOKENS:
        assert len(tok.encode(token).ids) == 1
    call = render_chat(
        [{"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": {"x": "1"}}]}],
        add_generation_prompt=False,
    )
    tokens = tok.encode(call).tokens
    assert tokens[tokens.index("<tool_call>") + 2 : tokens.index("<tool_call>") + 5] == [
        '{"name": "',
        "calculator",
        '", "arguments": ',
    ]


ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n",
    "$ grep -n 'TODO' src/*.py | wc -l",
    '{"name": "calculator", "arguments": {"expression": "12 * 34"}}',
    "tabs\tand\r\nwindows lines   trailing  ",
    "naïve café, 世界, emoji 🙂, NUL \x00 and DEL \x7f",
    "e\u0301 (decomposed) vs \u00e9 (composed)",
    "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=-(10**30), max_value=10**30), prefix=st.sampled_from(["", " ", "x=", "$"]))
def test_digits_are_one_token_each(tok, n, prefix):
    encoding = tok.encode(f"{prefix}{n}")
    digit_tokens = [t for t in encoding.tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == list(str(abs(n)))


# ---- chat template: exact strings per role -------------------------------------------------------------

CALL = {"name": "calculator", "arguments": {"expression": "2 * 3"}}
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'


def both(messages, tools=None, add_generation_prompt=True):
    text = render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert text == render_chat_jinja(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return text


def test_system_user_assistant_and_generation_prompt():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    turns = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    assert both(messages, add_generation_prompt=False) == turns
    assert both(messages) == turns + "<|im_start|>assistant\n"
    assert both([]) == "<|im_start|>assistant\n"


def test_assistant_tool_calls_and_tool_responses():
    messages = [
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, {"type": "function", "function": CALL}]},
        {"role": "tool", "content": "6"},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "6"},
    ]
    assert both(messages, add_generation_prompt=False) == (
        "<|im_start|>user\n2*3?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_TEXT}\n{CALL_TEXT}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n6<|im_end|>\n"
    )


def test_assistant_text_reasoning_and_string_arguments():
    messages = [
        {
            "role": "assistant",
            "reasoning_content": "use the tool",
            "content": "Let me check.",
            "tool_calls": [{"name": "calculator", "arguments": '{"expression": "2 * 3"}'}],
        }
    ]
    assert both(messages, add_generation_prompt=False) == (
        f"<|im_start|>assistant\n<think>\nuse the tool\n</think>\nLet me check.\n{CALL_TEXT}<|im_end|>\n"
    )


def test_tools_are_listed_in_the_system_turn():
    tool = {"type": "function", "function": {"name": "calculator", "description": "évalue <expr> & more"}}
    text = both([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], tools=[tool])
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n")
    # transformers' tojson: no HTML escaping, no ASCII escaping.
    assert "\n<tools>\n" + json.dumps(tool, ensure_ascii=False) + "\n</tools>\n" in text
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n")
    assert both([{"role": "user", "content": "u"}], tools=[tool]).startswith("<|im_start|>system\n# Tools\n")


@pytest.mark.parametrize(
    "messages, error",
    [
        ([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}], ValueError),
        ([{"role": "robot", "content": "u"}], ValueError),
        ([{"role": "user", "content": None}], TypeError),
    ],
)
def test_bad_messages_are_rejected_by_both_renderers(messages, error):
    with pytest.raises(error):
        render_chat(messages)
    with pytest.raises(Exception):  # noqa: B017 - jinja2 raises its own types for a None operand
        render_chat_jinja(messages)


# ---- Python renderer == Jinja template on generated conversations --------------------------------------

texts = st.text(max_size=30)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
tool_calls = st.lists(
    st.builds(
        lambda name, args, wrap: (
            {"type": "function", "function": {"name": name, "arguments": args}}
            if wrap
            else {"name": name, "arguments": args}
        ),
        texts,
        st.dictionaries(texts, json_values, max_size=3) | texts,
        st.booleans(),
    ),
    max_size=3,
)
turn = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, texts),
    st.builds(lambda c: {"role": "tool", "content": c}, texts),
    st.builds(lambda c: {"role": "assistant", "content": c}, texts),
    st.builds(lambda c, r: {"role": "assistant", "content": c, "reasoning_content": r}, texts, texts),
    st.builds(lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls}, texts, tool_calls)
    | st.builds(lambda calls: {"role": "assistant", "content": None, "tool_calls": calls}, tool_calls.filter(bool)),
)
conversations = st.builds(
    lambda system, rest: ([{"role": "system", "content": system}] if system is not None else []) + rest,
    st.none() | texts,
    st.lists(turn, max_size=8),
)
tool_lists = st.none() | st.lists(st.dictionaries(texts, json_values, min_size=1, max_size=3), max_size=3)


@settings(max_examples=500, deadline=None)
@given(messages=conversations, tools=tool_lists, add_generation_prompt=st.booleans())
def test_python_renderer_equals_jinja_template(messages, tools, add_generation_prompt):
    assert render_chat(messages, tools, add_generation_prompt) == render_chat_jinja(
        messages, tools, add_generation_prompt
    )


# ---- determinism and loaders ----------------------------------------------------------------------------

BUILD_IN_SUBPROCESS = "import sys; from gyre.models import build_tokenizer; build_tokenizer(sys.argv[1])"


def test_rebuild_in_fresh_processes_is_byte_identical(built, tmp_path):
    for i, seed in enumerate(("1", "2")):
        out = tmp_path / f"run{i}"
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        subprocess.run([sys.executable, "-c", BUILD_IN_SUBPROCESS, str(out)], check=True, timeout=120, env=env)
        for name in FILES:
            assert (out / name).read_bytes() == (built[0] / name).read_bytes(), name


def test_custom_corpus(tmp_path):
    out = build_tokenizer(tmp_path, vocab_size=300, corpus=["ab ab ab abc abc 123"] * 10)
    tokenizer = load_tokenizer(Path(out) / "tokenizer.json")
    assert tokenizer.get_vocab_size() <= 300  # merges run out on a tiny corpus
    assert tokenizer.decode(tokenizer.encode("abc 12").ids) == "abc 12"


def test_transformers_autotokenizer_loads_it(built, tok):
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the dev extra) is not installed; cross-check not run"
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(built[0]))
    assert (hf.eos_token, hf.pad_token_id) == ("<|im_end|>", SPECIAL_TOKENS.index("<|pad|>"))
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "408"},
    ]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == render_chat(messages)
    assert hf.encode(text, add_special_tokens=True) == tok.encode(text).ids
