"""gyre.proxy.output: detokenizing and parsing model output, streamed or at once, with the tiny model's tokenizer."""

from __future__ import annotations

import itertools
import json
import random
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.models.chat_template import render_chat
from gyre.proxy.conversation import AssistantOutput, TextDelta, ThinkingDelta, ToolCall, ToolCallDone
from gyre.proxy.output import Detokenizer, OutputDecoder, OutputParser, parse_output
from gyre.proxy.parsers.json_call import parse_json_call


@cache
def tiny_tokenizer():
    from gyre.models.tiny import tiny_model_dir
    from gyre.models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir())


def ids_counter(prefix: str = "call_"):
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


def merge(events):
    """Adjacent deltas of one kind joined, so chunkings compare equal."""
    out: list = []
    for event in events:
        if out and type(event) is type(out[-1]) and isinstance(event, TextDelta | ThinkingDelta):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def run_parser(chunks, engine_finish="stop", **options):
    parser = OutputParser(new_call_id=ids_counter(), **options)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    more, output = parser.finish(engine_finish)
    return events + more, output


def assert_output_is_merge(events, output: AssistantOutput):
    assert output.text == "".join(e.text for e in events if isinstance(e, TextDelta))
    assert output.thinking == "".join(e.text for e in events if isinstance(e, ThinkingDelta))
    assert output.tool_calls == tuple(e.call for e in events if isinstance(e, ToolCallDone))
    assert all(e.text for e in events if isinstance(e, TextDelta | ThinkingDelta))


def split_at(text: str, cuts) -> list[str]:
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


QWEN3_OUTPUT = (
    "<think>\nThe user wants two files read.\nLet me call the tool twice.\n</think>\n\n"
    "I'll read both files."
    '\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "read_file", "arguments": {"path": "b.txt", "limit": 10}}\n</tool_call>'
)


# ----------------------------------------------------------------------------- parser: examples


def test_qwen3_thinking_text_and_two_tool_calls():
    events, output = run_parser([QWEN3_OUTPUT])
    assert output == AssistantOutput(
        text="I'll read both files.",
        thinking="The user wants two files read.\nLet me call the tool twice.",
        tool_calls=(
            ToolCall(id="call_0", name="read_file", arguments='{"path": "a.txt"}'),
            ToolCall(id="call_1", name="read_file", arguments='{"path": "b.txt", "limit": 10}'),
        ),
        stop_reason="tool_calls",
    )
    assert [type(e) for e in merge(events)] == [ThinkingDelta, TextDelta, ToolCallDone, ToolCallDone]
    assert_output_is_merge(events, output)


def test_every_chunking_of_the_qwen3_output_gives_the_same_events():
    whole, output = run_parser([QWEN3_OUTPUT])
    for cut in range(len(QWEN3_OUTPUT) + 1):
        events, out = run_parser([QWEN3_OUTPUT[:cut], QWEN3_OUTPUT[cut:]])
        assert merge(events) == merge(whole), cut
        assert out == output
    events, out = run_parser(list(QWEN3_OUTPUT))
    assert merge(events) == merge(whole) and out == output


def test_streaming_releases_text_as_soon_as_it_cannot_be_a_tag():
    parser = OutputParser(new_call_id=ids_counter())
    assert parser.feed("Hello") == [TextDelta("Hello")]
    assert parser.feed(" <too") == []  # may become <tool_call>; the space is held until text follows
    assert parser.feed("ls") == [TextDelta(" <tools")]
    assert parser.feed("\n\n") == []
    events, output = parser.finish("stop")
    assert events == [] and output.text == "Hello <tools" and output.stop_reason == "stop"


def test_streaming_holds_back_a_partial_thinking_close():
    parser = OutputParser(new_call_id=ids_counter())
    assert parser.feed("<thi") == []
    assert parser.feed("nk>\nplan") == [ThinkingDelta("plan")]
    assert parser.feed("\n</th") == []
    assert parser.feed("ink>\n\nDone.") == [TextDelta("Done.")]
    assert parser.finish("stop")[1] == AssistantOutput(text="Done.", thinking="plan")


def test_glue_newlines_are_stripped_but_inner_whitespace_is_kept():
    output = parse_output(
        "  <think>\n\n  indented\n\nsecond\n\n</think>\n\n  answer  \n", "stop", new_call_id=ids_counter()
    )
    assert output.thinking == "  indented\n\nsecond"
    assert output.text == "answer"


def test_starts_in_thinking_and_unclosed_thinking():
    output = parse_output("\nreasoning\n</think>\n\nanswer", "stop", new_call_id=ids_counter(), starts_in_thinking=True)
    assert (output.thinking, output.text) == ("reasoning", "answer")
    cut_off = parse_output("<think>\nstill thinking\n", "length", new_call_id=ids_counter())
    assert cut_off == AssistantOutput(thinking="still thinking", stop_reason="length")


def test_think_tag_after_text_is_plain_text_and_tool_tags_in_thinking_are_thinking():
    assert parse_output("Hi <think>x</think>", "stop", new_call_id=ids_counter()).text == "Hi <think>x</think>"
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    output = parse_output(f"<think>{call}</think>ok", "stop", new_call_id=ids_counter())
    assert output == AssistantOutput(text="ok", thinking=call)


def test_closing_tag_inside_a_json_string_does_not_close_the_call():
    body = '{"name": "write", "arguments": {"path": "x.md", "text": "use </tool_call> to end"}}'
    _, output = run_parser([f"<tool_call>\n{body}\n</tool_call>"])
    assert output.tool_calls == (
        ToolCall(id="call_0", name="write", arguments='{"path": "x.md", "text": "use </tool_call> to end"}'),
    )
    assert output.text == "" and output.stop_reason == "tool_calls"
    escaped = '{"name": "w", "arguments": {"t": "a \\" </tool_call> b"}}'
    assert (
        parse_output(f"<tool_call>{escaped}</tool_call>", "stop", new_call_id=ids_counter()).tool_calls[0].arguments
        == '{"t": "a \\" </tool_call> b"}'
    )


def test_non_json_body_closes_at_the_first_closing_tag():
    text = "<tool_call>name: f</tool_call> then"
    assert parse_output(text, "stop", new_call_id=ids_counter()) == AssistantOutput(text=text)


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        '{"name": "f", "arguments": {"a": 1}',  # missing brace
        '{"arguments": {}}',  # no name
        '{"name": "", "arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": "not an object"}',
        '{"name": "f", "arguments": "[1]"}',
        '{"name": "f", "arguments": {"x": NaN}}',
        '{"name": "f", "arguments": {"x": "raw\nnewline"}}',
        '{"name": "f", "arguments": {}} trailing',
        '{"name": "f", "arguments": {}}{"name": "g", "arguments": {}}',
        "[" * 100_000,
    ],
)
def test_unparseable_tool_call_is_text(body):
    text = f"Let me try.\n<tool_call>\n{body}\n</tool_call>"
    events, output = run_parser([text])
    assert output == AssistantOutput(text=text, stop_reason="stop")
    assert_output_is_merge(events, output)


def test_unterminated_tool_call_is_text_at_finish():
    text = 'Calling\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}'
    for chunks in ([text], list(text)):
        events, output = run_parser(chunks, "length")
        assert output == AssistantOutput(text=text, stop_reason="length")
        assert_output_is_merge(events, output)


def test_arguments_as_json_string_missing_and_parameters_alias():
    assert parse_json_call('{"name": "f", "arguments": " {\\"a\\": 1} "}') == ("f", '{"a": 1}')
    assert parse_json_call('{"name": "f"}') == ("f", "{}")
    assert parse_json_call(' {"name":"f","parameters":{"b":[1,2]}} ') == ("f", '{"b":[1,2]}')
    assert parse_json_call('{"name": "f", "arguments": {"a": {"b": "}"}}, "extra": 1}') == (
        "f",
        '{"a": {"b": "}"}}',
    )


def test_stop_reasons():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    new_id = ids_counter
    assert parse_output(call, "stop", new_call_id=new_id()).stop_reason == "tool_calls"
    assert parse_output(call, "length", new_call_id=new_id()).stop_reason == "length"
    assert parse_output(call, "abort", new_call_id=new_id()).stop_reason == "abort"
    assert parse_output("hi", "stop", new_call_id=new_id()).stop_reason == "stop"
    assert parse_output("<tool_call>bad</tool_call>", "stop", new_call_id=new_id()).stop_reason == "stop"
    with pytest.raises(ValueError, match="engine_finish"):
        parse_output("hi", "eos", new_call_id=new_id())


def test_whitespace_between_tool_calls_is_not_text_but_text_after_them_is():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    events, output = run_parser([f"\n{call}\n \n{call}\n"])
    assert output.text == "" and len(output.tool_calls) == 2
    assert all(isinstance(e, ToolCallDone) for e in events)
    events, output = run_parser([f"Hi\n{call}\nBye\n"])
    assert output.text == "Hi\n\nBye"
    assert [type(e) for e in events] == [TextDelta, ToolCallDone, TextDelta]


def test_unknown_parser_names_are_errors_naming_the_known_ones():
    with pytest.raises(ValueError, match="tool_call_parser='mistral' is not a known parser: expected one of hermes"):
        OutputParser(new_call_id=ids_counter(), tool_call_parser="mistral")
    with pytest.raises(ValueError, match=r"reasoning_parser='qwen2' .* qwen3, qwen3-thinking, deepseek-r1, none"):
        OutputParser(new_call_id=ids_counter(), reasoning_parser="qwen2")


def test_no_reasoning_parser_leaves_think_tags_in_the_text():
    for name in (None, "none"):
        output = parse_output("<think>x</think>\nok", "stop", new_call_id=ids_counter(), reasoning_parser=name)
        assert output == AssistantOutput(text="<think>x</think>\nok")


def test_feed_after_finish_is_an_error():
    parser = OutputParser(new_call_id=ids_counter())
    parser.finish("stop")
    with pytest.raises(RuntimeError):
        parser.feed("x")


# ----------------------------------------------------------------------------- parser: properties

_PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<",
    "</",
    "<too",
    "<thi",
    "\n",
    "\n\n",
    " ",
    "{",
    "}",
    '"',
    "\\",
    ":",
    ",",
    '"name"',
    '"arguments"',
    '"f"',
    '{"a": 1}',
    '{"name": "f", "arguments": {"x": "</tool_call>"}}',
    '{"name": "g", "arguments": "{}"}',
    '<tool_call>\n{"name": "f", "arguments": {"x": "</tool_call>"}}\n</tool_call>',
    '<tool_call>{"name": "g", "arguments": "{}"}</tool_call>',
    "<think>\nhm\n</think>\n\n",
    "hello",
    "世界",
    "😀",
]
output_texts = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=5)), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    text=output_texts,
    cuts=st.lists(st.integers(0, 400), max_size=12),
    engine_finish=st.sampled_from(["stop", "length", "abort"]),
    starts_in_thinking=st.booleans(),
)
def test_any_chunking_gives_the_events_of_the_whole_text(text, cuts, engine_finish, starts_in_thinking):
    whole_events, whole_output = run_parser([text], engine_finish, starts_in_thinking=starts_in_thinking)
    events, output = run_parser(split_at(text, cuts), engine_finish, starts_in_thinking=starts_in_thinking)
    assert merge(events) == merge(whole_events)
    assert output == whole_output
    assert_output_is_merge(events, output)
    assert output.text == output.text.strip()
    assert parse_output(text, engine_finish, new_call_id=ids_counter(), starts_in_thinking=starts_in_thinking) == output


@settings(max_examples=100, deadline=None)
@given(
    args=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=12)), max_size=4),
    text=st.text(max_size=20),
    cuts=st.lists(st.integers(0, 300), max_size=8),
)
def test_valid_calls_round_trip_exactly(args, text, cuts):
    arguments = json.dumps(args, ensure_ascii=False)
    output_text = f'{text}\n<tool_call>\n{{"name": "tool", "arguments": {arguments}}}\n</tool_call>'
    _, output = run_parser(split_at(output_text, cuts))
    if "<tool_call>" in text or "<think>" in text.lstrip()[:7]:
        return  # the free text itself opened a block or thinking; covered by the chunking property
    assert output.tool_calls == (ToolCall(id="call_0", name="tool", arguments=arguments),)
    assert output.text == text.strip()


# ----------------------------------------------------------------------------- detokenizer


def detokenize(tok, id_chunks, skip_ids=()):
    detok = Detokenizer(tok, skip_ids=skip_ids)
    pieces = [detok.feed(chunk) for chunk in id_chunks]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", ["😀", "中文字符 and 😀🎉 mixed, é ü ß", "naïve 日本語テキスト 👩‍👩‍👧 ok"])
def test_detokenizer_never_splits_a_character_at_any_split(text):
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text)  # multi-byte characters span several ids in the tiny vocabulary
    for cut in range(len(ids) + 1):
        pieces, rest = detokenize(tok, [ids[:cut], ids[cut:]])
        assert "".join(pieces) + rest == text
        assert rest == "" and not any("\ufffd" in p for p in pieces)
    pieces, rest = detokenize(tok, [[i] for i in ids])
    assert "".join(pieces) == text and rest == ""
    assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_holds_an_incomplete_character_until_flush():
    tok = tiny_tokenizer()
    ids = tok.encode("a😀", add_special_tokens=False).ids
    detok = Detokenizer(tok)
    assert detok.feed(ids[:-1]) == "a"
    assert detok.flush() == "\ufffd"


def test_detokenizer_drops_skip_ids():
    tok = tiny_tokenizer()
    im_end, eot, think = (tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<think>"))
    ids = [think, *tok.encode("ok", add_special_tokens=False).ids, im_end, eot]
    pieces, rest = detokenize(tok, [ids], skip_ids={im_end, eot})
    assert "".join(pieces) + rest == "<think>ok"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(st.integers(0, 511), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=10),
    skip=st.sets(st.integers(0, 9), max_size=3),
)
def test_detokenizer_pieces_join_to_the_full_decode(ids, cuts, skip):
    tok = tiny_tokenizer()
    points = sorted(set(min(c, len(ids)) for c in cuts))
    chunks = [ids[a:b] for a, b in zip([0, *points], [*points, len(ids)], strict=True)]
    pieces, rest = detokenize(tok, chunks, skip_ids=skip)
    expected = tok.decode([i for i in ids if i not in skip], skip_special_tokens=False)
    assert "".join(pieces) + rest == expected


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_detokenizer_pieces_of_valid_text_are_whole_characters(text, cuts):
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    points = sorted(set(min(c, len(ids)) for c in cuts))
    chunks = [ids[a:b] for a, b in zip([0, *points], [*points, len(ids)], strict=True)]
    pieces, rest = detokenize(tok, chunks)
    assert "".join(pieces) + rest == text
    if "\ufffd" not in text:
        assert rest == "" and not any("\ufffd" in p for p in pieces)


class CountingTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", ["plain words " * 100, "中文😀" * 100, "\ufffd" * 300, "x\ufffd😀" * 100])
def test_detokenizer_decodes_a_bounded_window(text):
    tok = tiny_tokenizer()
    counting = CountingTokenizer(tok)
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces, rest = detokenize(counting, [[i] for i in ids])
    assert "".join(pieces) + rest == text
    assert counting.longest <= Detokenizer.CUT_CANDIDATES + 4


def test_detokenizer_window_stays_bounded_on_invalid_bytes():
    tok = tiny_tokenizer()
    counting = CountingTokenizer(tok)
    continuation = tok.encode("\u00e9", add_special_tokens=False).ids[-1]  # 0xA9: a lone continuation byte
    lead = tok.encode("\u4e2d", add_special_tokens=False).ids[0]  # 0xE4: starts a 3-byte character
    ids = [continuation] * 100 + [lead, continuation] * 50
    pieces, rest = detokenize(counting, [[i] for i in ids])
    assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=False)
    assert counting.longest <= Detokenizer.CUT_CANDIDATES + 4


# ----------------------------------------------------------------------------- decoder: the tiny model's format


def test_tiny_template_round_trip_through_the_decoder():
    tok = tiny_tokenizer()
    user = {"role": "user", "content": "Summarize 中文 notes 😀 then list files."}
    assistant = {
        "role": "assistant",
        "reasoning_content": "Need the files first. 先看文件",
        "content": "Looking — 一下 😀.",
        "tool_calls": [
            {"name": "list_files", "arguments": {"dir": "notes/日本", "glob": "*.md"}},
            {"function": {"name": "read", "arguments": {"path": "a b.txt", "text": "x </tool_call> y", "n": [1, 2.5]}}},
        ],
    }
    prompt = render_chat([user], add_generation_prompt=True)
    full = render_chat([user, assistant], add_generation_prompt=False)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
    output_text = full[len(prompt) : -len("\n")]  # the model stops at <|im_end|>
    ids = tok.encode(output_text, add_special_tokens=False).ids
    stop_ids = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert ids[-1] in stop_ids

    expected_calls = (
        ToolCall(id="call_0", name="list_files", arguments='{"dir": "notes/日本", "glob": "*.md"}'),
        ToolCall(id="call_1", name="read", arguments='{"path": "a b.txt", "text": "x </tool_call> y", "n": [1, 2.5]}'),
    )
    rng = random.Random(0)
    reference = None
    for trial in range(30):
        decoder = OutputDecoder(tok, skip_ids=stop_ids, new_call_id=ids_counter())
        events, i = [], 0
        while i < len(ids):
            step = 1 if trial == 0 else rng.randint(1, 7)
            events += decoder.feed(ids[i : i + step])
            i += step
        more, output = decoder.finish("stop")
        events += more
        assert output == AssistantOutput(
            text="Looking — 一下 😀.",
            thinking="Need the files first. 先看文件",
            tool_calls=expected_calls,
            stop_reason="tool_calls",
        )
        assert_output_is_merge(events, output)
        reference = reference or merge(events)
        assert merge(events) == reference


def test_tiny_template_tool_calls_only_and_length_cutoff():
    tok = tiny_tokenizer()
    user = {"role": "user", "content": "go"}
    assistant = {"role": "assistant", "content": "", "tool_calls": [{"name": "run", "arguments": {"cmd": "ls -la"}}]}
    prompt = render_chat([user])
    output_text = render_chat([user, assistant], add_generation_prompt=False)[len(prompt) :]
    ids = tok.encode(output_text, add_special_tokens=False).ids
    stop_ids = {tok.token_to_id("<|im_end|>")}
    decoder = OutputDecoder(tok, skip_ids=stop_ids, new_call_id=ids_counter("toolu_"))
    events = decoder.feed(ids)
    more, output = decoder.finish("stop")
    assert output == AssistantOutput(
        tool_calls=(ToolCall(id="toolu_0", name="run", arguments='{"cmd": "ls -la"}'),), stop_reason="tool_calls"
    )
    assert events + more == [ToolCallDone(output.tool_calls[0])]

    cut = ids[: len(ids) // 2]  # cut off inside the call body
    decoder = OutputDecoder(tok, skip_ids=stop_ids, new_call_id=ids_counter())
    events = decoder.feed(cut)
    more, output = decoder.finish("length")
    assert output.stop_reason == "length" and output.tool_calls == ()
    assert output.text == tok.decode(cut, skip_special_tokens=False).strip()
    assert output.text.startswith("<tool_call>")
