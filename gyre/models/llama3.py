"""The Llama 3 vocabulary and chat template in HF layout, built offline from the ranks Meta's `llama-models` ships.

The PyPI package `llama-models` (0.3.0; Meta's reference code, Llama 3 Community License) carries
`llama_models/llama3/tokenizer.model`: the 128,000 byte-level BPE ranks of Llama 3, 3.1, 3.2 and 3.3 in tiktoken's
format. `llama3_tokenizer_json()` turns them into a `tokenizer.json` with `gyre.models.qwen_vocab`'s builder (merges
derived from the ranks), Llama 3's pre-tokenizer pattern (`LLAMA3_PATTERN`: digits in runs of up to three, no NFC
normalizer) and its 256 special tokens from id 128,000 (`LLAMA3_SPECIAL_TOKENS`, named as `llama-models`'
`llama3/tokenizer.py` names them: Llama 3.1+'s `<|eom_id|>`, `<|python_tag|>`, `<|finetune_right_pad_id|>`;
the reserved slots' names differ between 3.0, 3.1 and 3.2 releases), cached under the gyre cache like Qwen's.
Unlike Meta's HF `tokenizer.json`, no post-processor adds `<|begin_of_text|>`: the chat template writes it, and
gyre encodes rendered prompts without added tokens.

The chat template (`llama3_chat_template.jinja`, `render_llama3_chat`) is Llama 3's (Meta-Llama-3-8B-Instruct;
read from `trl/chat_templates/llama3.jinja` in the trl-1.16.0 wheel): `bos_token` once, then per message
`<|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|>`, and the generation prompt
`<|start_header_id|>assistant<|end_header_id|>\n\n`. It has no tool format: `tool_calls` are not rendered, a tool
message is a turn of role `tool` (Llama 3.1's `ipython` tool template is not reproduced). Ours raises for a
non-string content, which Llama 3's renders as the text "None".

Without `llama-models` installed, `llama3_tokenizer_json` and `build_llama3_tokenizer` raise `MissingVocabulary`
naming `pip install llama-models` (the `dev` extra). Importing this module imports neither tokenizers nor jinja2.
Tests: tests/unit/test_models_families.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gyre.models.qwen_vocab import (
    TOKENIZER_FILE,
    added_tokens_decoder,
    cached_tokenizer_json,
    package_file,
    read_tiktoken_ranks,
    tokenizer_from_ranks,
    write_json,
)

LLAMA3_PATTERN = (  # Qwen's but digits in runs of up to three
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_RANKS = 128000
_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of a message that expects a tool result
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
    "<|image|>",
)
# 256 special tokens from id 128,000, every one special.
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = _NAMED_SPECIALS + tuple(
    f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_NAMED_SPECIALS))
)
LLAMA3_VOCAB_SIZE = LLAMA3_NUM_RANKS + len(LLAMA3_SPECIAL_TOKENS)  # 128,256: config.json's vocab_size, no padding
LLAMA3_BOS, LLAMA3_EOT, LLAMA3_PAD = "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"
# Llama 3.1 Instruct's generation_config.json eos_token_id: end_of_text, eom_id, eot_id.
LLAMA3_STOP_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
VOCAB_PACKAGE, VOCAB_MODULE, RANKS_FILE = "llama-models", "llama_models", "llama3/tokenizer.model"
CACHE_PREFIX = "vocab-llama3-"
TEMPLATE_PATH = Path(__file__).with_name("llama3_chat_template.jinja")
LLAMA3_CHAT_TEMPLATE: str = TEMPLATE_PATH.read_text(encoding="utf-8")


def llama3_token_id(token: str) -> int:
    """The id of one of `LLAMA3_SPECIAL_TOKENS`."""
    return LLAMA3_NUM_RANKS + LLAMA3_SPECIAL_TOKENS.index(token)


def llama3_ranks_path() -> Path:
    """`llama_models/llama3/tokenizer.model` of the installed `llama-models`."""
    return package_file(VOCAB_PACKAGE, VOCAB_MODULE, RANKS_FILE)


def build_llama3_tokenizer_object(ranks_path: str | Path | None = None) -> Any:
    """The Llama 3 `tokenizers.Tokenizer` built from the ranks (in memory; `llama3_tokenizer_json` caches)."""
    ranks = read_tiktoken_ranks(llama3_ranks_path() if ranks_path is None else ranks_path)
    if len(ranks) != LLAMA3_NUM_RANKS:
        raise ValueError(f"expected {LLAMA3_NUM_RANKS} Llama 3 ranks, got {len(ranks)}")
    added = [(token, True) for token in LLAMA3_SPECIAL_TOKENS]
    return tokenizer_from_ranks(ranks, pattern=LLAMA3_PATTERN, added_tokens=added, nfc=False, every_split=True)


def llama3_tokenizer_json(cache_root: str | Path | None = None) -> Path:
    """The path of the cached Llama 3 `tokenizer.json`, built on first use."""
    ranks_path = llama3_ranks_path()
    key = (ranks_path.read_bytes(), Path(__file__).read_bytes(), Path(__file__).with_name("qwen_vocab.py").read_bytes())
    return cached_tokenizer_json(CACHE_PREFIX, key, lambda: build_llama3_tokenizer_object(ranks_path), cache_root)


def build_llama3_tokenizer(out_dir: str | Path, cache_root: str | Path | None = None) -> Path:
    """Write Llama 3's `tokenizer.json`, `tokenizer_config.json` (with our Llama 3 chat template) and
    `special_tokens_map.json` into `out_dir`; returns `out_dir`."""
    source = llama3_tokenizer_json(cache_root)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_bytes(source.read_bytes())
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": LLAMA3_BOS,
            "eos_token": LLAMA3_EOT,  # Instruct: a turn ends generation
            "pad_token": LLAMA3_PAD,
            "clean_up_tokenization_spaces": True,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "added_tokens_decoder": added_tokens_decoder(
                LLAMA3_NUM_RANKS, [(token, True) for token in LLAMA3_SPECIAL_TOKENS]
            ),
            "chat_template": LLAMA3_CHAT_TEMPLATE,
        },
    )
    write_json(
        out / "special_tokens_map.json", {"bos_token": LLAMA3_BOS, "eos_token": LLAMA3_EOT, "pad_token": LLAMA3_PAD}
    )
    return out


def render_llama3_chat(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, bos_token: str = LLAMA3_BOS
) -> str:
    """Render `messages` as Llama 3's template does; equals `render_llama3_chat_jinja`."""
    parts: list[str] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: the Llama 3 template renders string contents only")
        if not isinstance(role, str):
            raise TypeError(f"messages[{i}].role: expected str, got {type(role).__name__}")
        if i == 0:
            parts.append(bos_token)
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>")
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def render_llama3_chat_jinja(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, bos_token: str = LLAMA3_BOS
) -> str:
    """Render with the Jinja `LLAMA3_CHAT_TEMPLATE` in transformers' environment (needs jinja2)."""
    from gyre.models.chat_template import compiled_jinja

    return compiled_jinja(LLAMA3_CHAT_TEMPLATE).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos_token
    )
