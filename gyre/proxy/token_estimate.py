"""About how many tokens a request holds, from a bounded sample of its text: `count_tokens` beyond the context.

`POST /v1/messages/count_tokens` answers the exact count of any prompt the model can take (at most the context
limit). A prompt beyond it cannot be served, and counting all of it exactly would cost the proxy time and memory in
proportion to a body a client chose (a 10 MB text: 10.25 s of tokenizing and 1.1 GB held, measured). There
the answer is an estimate, as Anthropic documents its own counts to be: the text's characters times the tokens per
character of `SAMPLE_SLICES` evenly spaced slices of it, `SAMPLE_CHARS` characters in all, so the work is bounded
whatever the body (docs/proxy.md, "Counting tokens").

Pure: `encode_many` is handed in; nothing here reads a tokenizer or a socket.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gyre.proxy.conversation import ChatRequest

__all__ = [
    "SAMPLE_CHARS",
    "SAMPLE_SLICES",
    "TextSample",
    "estimate_from_sample",
    "estimate_tokens",
    "request_texts",
    "sample_texts",
]

SAMPLE_CHARS = 32_768  # characters encoded to estimate a prompt, at most (tens of ms of tokenizing)
SAMPLE_SLICES = 16  # spread over the text: one odd stretch (a base64 blob, a run of spaces) weighs 1/16


def request_texts(request: ChatRequest) -> list[str]:
    """The texts a rendering of `request` holds: system prompt, turns (text, thinking, tool calls) and tools."""
    texts = [request.system or ""]
    for turn in request.turns:
        texts += [turn.text, turn.thinking]
        texts += [f"{call.name} {call.arguments}" for call in turn.tool_calls]
    texts += [json.dumps(tool.as_template_tool(), ensure_ascii=False) for tool in request.tools]
    return [text for text in texts if text]


def _slices(texts: Sequence[str], total: int, slices: int, width: int) -> list[str]:
    """`slices` pieces of `width` characters at evenly spaced offsets of the texts laid end to end."""
    starts = [round(i * (total - width) / max(slices - 1, 1)) for i in range(slices)]
    pieces: list[str] = []
    offset, index = 0, 0  # the offset where texts[index] begins
    for start in starts:
        while offset + len(texts[index]) <= start:
            offset += len(texts[index])
            index += 1
        local = start - offset
        piece = texts[index][local : local + width]
        rest, following = width - len(piece), index + 1
        while rest > 0 and following < len(texts):  # a slice across texts takes the next one's head
            piece += texts[following][:rest]
            rest, following = width - len(piece), following + 1
        pieces.append(piece)
    return pieces


@dataclass(frozen=True)
class TextSample:
    """What an estimate encodes of some texts: all of them (`whole`), or evenly spaced slices, and their length."""

    total_chars: int
    pieces: list[str]
    whole: bool

    def as_json(self) -> dict:
        return {"total_chars": self.total_chars, "pieces": self.pieces, "whole": self.whole}

    @classmethod
    def from_json(cls, data: dict) -> TextSample:
        return cls(int(data["total_chars"]), [str(piece) for piece in data["pieces"]], bool(data["whole"]))


def sample_texts(texts: Sequence[str], *, sample_chars: int = SAMPLE_CHARS, slices: int = SAMPLE_SLICES) -> TextSample:
    """At most `sample_chars` characters of `texts` to encode: the texts themselves when they fit, else `slices`
    evenly spaced slices of them laid end to end."""
    texts = [text for text in texts if text]
    total = sum(len(text) for text in texts)
    if total <= sample_chars:
        return TextSample(total, texts, whole=True)
    slices = max(min(slices, sample_chars), 1)
    return TextSample(total, _slices(texts, total, slices, sample_chars // slices), whole=False)


def estimate_from_sample(sample: TextSample, encode_many: Callable[[list[str]], Sequence[Sequence[int]]]) -> int:
    """The texts' tokens: exact for a whole sample, else the slices' tokens per character scaled to the whole."""
    if sample.whole:
        return sum(map(len, encode_many(sample.pieces)))
    sampled_chars = sum(len(piece) for piece in sample.pieces)
    sampled_tokens = sum(map(len, encode_many(sample.pieces)))
    return max(1, round(sample.total_chars * sampled_tokens / sampled_chars))


def estimate_tokens(
    texts: Sequence[str],
    encode_many: Callable[[list[str]], Sequence[Sequence[int]]],
    *,
    sample_chars: int = SAMPLE_CHARS,
    slices: int = SAMPLE_SLICES,
) -> int:
    """About how many tokens `texts` encode to (each on its own), encoding at most `sample_chars` characters, in
    one call of `encode_many` (a list of texts -> their ids; the proxy's releases the GIL).

    Texts that fit the sample are encoded whole (exact); otherwise `slices` evenly spaced slices of them are, and
    their tokens per character scale to the whole. A slice cut mid-word can add a token at each end, so on text of
    a few characters per token the estimate runs high by a fraction of a percent."""
    return estimate_from_sample(sample_texts(texts, sample_chars=sample_chars, slices=slices), encode_many)
