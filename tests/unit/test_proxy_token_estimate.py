"""The sampled token estimate of count_tokens beyond the context limit (`gyre.proxy.token_estimate`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gyre.proxy.conversation import ChatRequest, ToolCall, ToolSpec, Turn
from gyre.proxy.token_estimate import SAMPLE_CHARS, _slices, estimate_tokens, request_texts


def words(texts: list[str]) -> list[list[str]]:
    """A stand-in tokenizer: one token a word (whitespace-separated)."""
    return [text.split() for text in texts]


def characters(texts: list[str]) -> list[list[str]]:
    return [list(text) for text in texts]


class Recorder:
    """An `encode_many` that counts the characters it was given and its calls."""

    def __init__(self, encode_many):
        self.encode_many, self.chars, self.calls = encode_many, 0, 0

    def __call__(self, texts: list[str]):
        self.chars += sum(map(len, texts))
        self.calls += 1
        return self.encode_many(texts)


def test_texts_that_fit_the_sample_are_counted_exactly():
    assert estimate_tokens(["a b c", "", "d e"], words, sample_chars=100) == 5


def test_a_long_uniform_text_is_estimated_within_a_percent_encoding_only_the_sample():
    text = "lorem ipsum dolor sit amet " * 100_000
    encode = Recorder(words)
    estimate = estimate_tokens([text], encode)  # 16 slices of 2,048 characters
    assert abs(estimate - 500_000) <= 0.01 * 500_000
    assert encode.chars <= SAMPLE_CHARS and encode.calls == 1


def test_an_odd_stretch_weighs_by_its_share_of_the_text():
    """Half the characters dense (one token a character), half sparse: the estimate sees both halves."""
    dense, sparse = "x " * 50_000, "y" * 100_000
    estimate = estimate_tokens([dense, sparse], words, sample_chars=8_192, slices=32)
    assert 40_000 <= estimate <= 60_000  # exact: 50,001


@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    slices=st.integers(1, 12),
    width=st.integers(1, 40),
)
def test_slices_lie_in_the_texts_laid_end_to_end(lengths, slices, width):
    texts = ["".join(chr(65 + (i + j) % 26) for j in range(n)) for i, n in enumerate(lengths)]
    texts = [text for text in texts if text]
    joined = "".join(texts)
    if len(joined) <= width:
        return
    pieces = _slices(texts, len(joined), slices, width)
    assert len(pieces) == slices
    for piece in pieces:
        assert len(piece) == width and piece in joined
    # each at its evenly spaced offset of the whole (the alphabet repeats, so `in` alone would not tell)
    starts = [round(i * (len(joined) - width) / max(slices - 1, 1)) for i in range(slices)]
    assert pieces == [joined[start : start + width] for start in starts]


@given(st.lists(st.text(max_size=200), max_size=12), st.integers(1, 400))
def test_the_encoded_characters_never_exceed_the_sample(texts, sample_chars):
    encode = Recorder(characters)
    estimate_tokens(texts, encode, sample_chars=sample_chars, slices=8)
    assert encode.chars <= sample_chars and encode.calls <= 1


def test_a_request_s_texts_are_its_system_turns_tool_calls_and_tools():
    request = ChatRequest(
        dialect="anthropic",
        model="m",
        system="be brief",
        turns=(
            Turn(role="user", text="hello"),
            Turn(role="assistant", thinking="hmm", tool_calls=(ToolCall(id="c1", name="ls", arguments="{}"),)),
            Turn(role="tool", text="a.txt", tool_call_id="c1"),
        ),
        tools=(ToolSpec(name="ls", description="list files"),),
    )
    texts = request_texts(request)
    assert texts[:5] == ["be brief", "hello", "hmm", "ls {}", "a.txt"]
    assert "list files" in texts[5] and len(texts) == 6
