"""The token floor (gyre.proxy.token_floor) and the prompt builder's limit (issue 13, finding 8).

The floor must never exceed the real count: a property test encodes arbitrary text (Unicode, special tokens, digits,
whitespace runs) with the tiny model's tokenizer. Tokenizers that can drop text get no floor. A builder with
`max_tokens` refuses a huge prompt without encoding it and keeps its previous state.
"""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from gyre.models.tiny import tiny_model_dir
from gyre.proxy.conversation import ChatRequest, Turn
from gyre.proxy.render import ChatTemplate, PromptBuilder, PromptTooLong
from gyre.proxy.token_floor import bytes_per_token_bound, token_floor


@cache
def template() -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model_dir())


def byte_level_bpe(**parts) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab["ĠĠ"] = len(vocab)
    vocab["ĠĠĠĠ"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "Ġ"), ("ĠĠ", "ĠĠ")]))
    tokenizer.pre_tokenizer = parts.get("pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=False))
    tokenizer.decoder = decoders.ByteLevel()
    if "normalizer" in parts:
        tokenizer.normalizer = parts["normalizer"]
    return tokenizer


def test_the_tiny_tokenizer_has_a_floor_of_its_longest_token():
    tokenizer = template().tokenizer
    longest = max(len(symbols) for symbols in tokenizer.get_vocab(with_added_tokens=False))
    assert template().bytes_per_token == bytes_per_token_bound(tokenizer) == max(longest, len("<|endoftext|>")) == 16


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(max_size=200),
            st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", " " * 40, "0123456789" * 5, "\n\n\n"]),
            st.text(alphabet="abcdefghij ", max_size=400),
        ),
        max_size=12,
    )
)
def test_the_floor_never_exceeds_the_real_count(pieces):
    text = "".join(pieces)
    assert token_floor(len(text), template().bytes_per_token) <= len(template().encode(text))


def test_byte_level_bpe_has_a_floor_and_a_unicode_normalizer_divides_it_by_four():
    assert bytes_per_token_bound(byte_level_bpe()) == 4
    isolating = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "isolated"), pre_tokenizers.ByteLevel()])
    assert bytes_per_token_bound(byte_level_bpe(pre_tokenizer=isolating)) == 4  # Qwen's shape: split, then bytes
    assert bytes_per_token_bound(byte_level_bpe(normalizer=normalizers.NFKC())) == 16
    mapped = "\U0001d400" * 10  # MATHEMATICAL BOLD CAPITAL A: 4 bytes, "A" after NFKC
    tokenizer = byte_level_bpe(normalizer=normalizers.NFKC())
    assert token_floor(len(mapped), 16) <= len(tokenizer.encode(mapped).ids)


@pytest.mark.parametrize(
    "parts",
    [
        {"normalizer": normalizers.Strip()},
        {"normalizer": normalizers.Sequence([normalizers.NFC(), normalizers.Replace("aaaa", "b")])},
        {"pre_tokenizer": pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()])},
        {"pre_tokenizer": pre_tokenizers.Sequence([pre_tokenizers.Split("x", "removed"), pre_tokenizers.ByteLevel()])},
        {"pre_tokenizer": pre_tokenizers.Whitespace()},
    ],
)
def test_a_tokenizer_that_can_drop_text_has_no_floor(parts):
    assert bytes_per_token_bound(byte_level_bpe(**parts)) is None


def test_an_added_token_that_swallows_whitespace_or_a_wordpiece_model_has_no_floor():
    tokenizer = byte_level_bpe()
    tokenizer.add_special_tokens([AddedToken("<s>", lstrip=True)])
    assert bytes_per_token_bound(tokenizer) is None
    wordpiece = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert bytes_per_token_bound(wordpiece) is None
    assert bytes_per_token_bound(object()) is None
    assert token_floor(1000, None) == 0


def chat(*texts: str) -> ChatRequest:
    turns = []
    for i, text in enumerate(texts):
        turns.append(Turn(role="user" if i % 2 == 0 else "assistant", text=text))
    return ChatRequest(dialect="anthropic", model="tiny", system="sys", turns=tuple(turns), tools=())


class CountingTemplate:
    """The tiny template, counting the characters it is asked to encode."""

    def __init__(self, inner: ChatTemplate):
        self.inner, self.encoded = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return self.inner.encode(text)


def test_a_huge_new_turn_is_refused_before_it_is_encoded_and_the_builder_keeps_its_state():
    counting = CountingTemplate(template())
    builder = PromptBuilder(counting, windowed=True)
    first = builder.build(chat("hello"), max_tokens=4000)
    huge = chat("hello", "hi there", "word " * 2_000_000)
    with pytest.raises(PromptTooLong) as refused:
        builder.build(huge, max_tokens=4000)
    assert refused.value.at_least > 4000 and refused.value.limit == 4000
    assert max(counting.encoded) < 100_000  # the 10 MB text was never tokenized
    again = builder.build(chat("hello", "hi there", "and now?"), max_tokens=4000)
    assert again.reused_turns == 1 and again.segments[0] is first.segments[0]  # extends "hello", as if no refusal


def test_a_prompt_over_the_limit_whose_floor_is_under_it_is_refused_with_its_exact_count():
    digits = "7" * 20_000  # one token per digit (the tiny tokenizer splits digits): floor 1,250, count 20,000
    builder = PromptBuilder(template(), windowed=True)
    with pytest.raises(PromptTooLong) as refused:
        builder.build(chat(digits), max_tokens=4000)
    assert refused.value.at_least >= 20_000
    assert builder.build(chat(digits)).num_tokens >= 20_000  # no limit: built whole


def test_pending_chars_counts_only_the_turns_past_the_previous_request():
    builder = PromptBuilder(template(), windowed=True)
    assert builder.pending_chars(chat("a" * 100)) == 100 + len("sys")
    builder.build(chat("a" * 100))
    assert builder.pending_chars(chat("a" * 100, "b" * 10, "c" * 1000)) == 1010
    assert [turn.text for turn in builder.pending_turns(chat("a" * 100, "b"))] == ["b"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant"]), st.text(max_size=300)), min_size=1, max_size=8))
def test_the_prompt_floor_never_exceeds_the_rendered_prompts_count(turns):
    request = ChatRequest(
        dialect="anthropic",
        model="tiny",
        system="sys",
        turns=tuple(Turn(role=role, text=text) for role, text in turns),
        tools=(),
    )
    assert template().keeps_contents
    assert template().prompt_floor(request.turns) <= len(template().encode(template().render_request(request)))


def test_a_template_that_drops_messages_gives_no_prompt_floor():
    last_only = (
        "{% for m in messages[-1:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    dropping = ChatTemplate(template().tokenizer, last_only, eos_token="<|im_end|>")
    assert not dropping.keeps_contents
    assert dropping.prompt_floor(chat("x" * 100_000).turns) == 0
