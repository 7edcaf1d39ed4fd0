"""The fewest tokens a text can encode to, known without encoding it: refuse a huge prompt before tokenizing it.

A byte-level BPE tokenizer (GPT-2's scheme: Qwen, Llama 3, DeepSeek, gyre's tiny model) turns every byte of the
normalized text into one symbol of its byte alphabet, and every token is a vocabulary entry of at most `L` such
symbols (an added token: at most its own UTF-8 length). So a text of `b` bytes encodes to at least `b / L` tokens.
A Unicode normalizer (NFC, NFKC, NFD, NFKD) can shrink a character at most from 4 UTF-8 bytes to 1 (NFKC maps U+1D400
to "A"), so with one the floor is `b / (4 L)`. `chars <= bytes`, so `len(text) / bound` is a floor too, and costs
nothing to compute.

Anything else can drop text (a Strip or Replace normalizer, a pre-tokenizer that removes what it matches, an added
token that swallows the whitespace beside it, a WordPiece or Unigram model mapping a long word to one unknown
token): then there is no floor (`bytes_per_token_bound` is None) and every prompt is tokenized before it is judged.
The floor only ever refuses a prompt early; the exact count after encoding decides everything else
(docs/proxy.md, "One call").
"""

from __future__ import annotations

import json
from typing import Any

UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
MAX_NORMALIZER_SHRINK = 4  # UTF-8 bytes of one character before a Unicode normalizer, at most, per byte after
SPLITTING_PRE_TOKENIZERS = frozenset({"Digits", "Split", "Punctuation"})  # keep every byte unless "removed"


def _state(component: Any) -> dict | None:
    """The JSON description of a tokenizers component (normalizer, pre-tokenizer), or None if it has none."""
    if component is None:
        return None
    return json.loads(component.__getstate__())


def _parts(state: dict) -> list[dict]:
    if state.get("type") == "Sequence":
        return [part for key in ("normalizers", "pretokenizers") for part in state.get(key, [])]
    return [state]


def _normalizer_shrink(state: dict | None) -> int | None:
    """By how much the normalizer may shrink text in bytes (1: not at all), None if it may drop text."""
    if state is None:
        return 1
    kinds = {part.get("type") for part in _parts(state)}
    return MAX_NORMALIZER_SHRINK if kinds <= UNICODE_NORMALIZERS else None


def _keeps_every_byte(state: dict | None) -> bool:
    """The pre-tokenizer is byte-level, and what splits before it drops nothing."""
    if state is None:
        return False
    parts = _parts(state)
    byte_level = any(part.get("type") == "ByteLevel" for part in parts)
    others_keep = all(
        part.get("type") == "ByteLevel"
        or (part.get("type") in SPLITTING_PRE_TOKENIZERS and str(part.get("behavior", "Isolated")) != "Removed")
        for part in parts
    )
    return byte_level and others_keep


def bytes_per_token_bound(tokenizer: Any) -> int | None:
    """`B` such that every text of `n` characters encodes to at least `ceil(n / B)` tokens; None if unknown.

    `tokenizer` is a `tokenizers.Tokenizer`; anything else (or any doubt) gives None."""
    try:
        if type(tokenizer.model).__name__ != "BPE" or not _keeps_every_byte(_state(tokenizer.pre_tokenizer)):
            return None
        shrink = _normalizer_shrink(_state(tokenizer.normalizer))
        added = list(tokenizer.get_added_tokens_decoder().values())
        vocab = tokenizer.get_vocab(with_added_tokens=False)
    except (AttributeError, TypeError, ValueError):
        return None
    if shrink is None or any(token.lstrip or token.rstrip for token in added):
        return None
    longest = max((len(symbols) for symbols in vocab), default=1)  # one symbol per byte
    longest = max([longest, *(len(token.content.encode("utf-8")) for token in added)])
    return shrink * max(longest, 1)


def token_floor(chars: int, bound: int | None) -> int:
    """The fewest tokens texts of `chars` characters in all, under `bytes_per_token_bound` `bound`, can encode to
    (0 when there is no bound)."""
    return -(-chars // bound) if bound else 0
