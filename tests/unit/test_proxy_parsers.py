"""gyre.proxy.parsers: the registry, its config keys, the hermes and llama3 tool-call dialects, the reasoning parsers,
and every dialect through `OutputDecoder` with the tiny model's tokenizer (qwen3_coder's own tests:
test_proxy_parsers_qwen3_coder.py).
"""

from __future__ import annotations

import json
import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_proxy_output import assert_output_is_merge, ids_counter, merge, run_parser, split_at, tiny_tokenizer

from gyre.config import ConfigError, ProxyConfig
from gyre.config.proxy import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
from gyre.proxy.conversation import AssistantOutput, TextDelta, ThinkingDelta, ToolCall, ToolCallDone, ToolSpec
from gyre.proxy.output import OutputDecoder, parse_output, prompt_opens_thinking
from gyre.proxy.parsers.registry import REASONING_PARSERS, TOOL_CALL_PARSERS

PARSER_LOG = "gyre.proxy.parsers.base"


def parse(text: str, engine_finish: str = "stop", **options) -> AssistantOutput:
    return parse_output(text, engine_finish, new_call_id=ids_counter(), **options)


def calls(*pairs) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(id=f"call_{i}", name=name, arguments=args) for i, (name, args) in enumerate(pairs))


def assert_every_chunking_agrees(text: str, **options) -> AssistantOutput:
    whole, output = run_parser([text], **options)
    for cut in range(len(text) + 1):
        events, out = run_parser([text[:cut], text[cut:]], **options)
        assert merge(events) == merge(whole), cut
        assert out == output
    events, out = run_parser(list(text), **options)
    assert merge(events) == merge(whole) and out == output
    assert_output_is_merge(events, output)
    return output


# ----------------------------------------------------------------------------- registry and config


def test_the_config_names_are_the_registry_names():
    assert tuple(TOOL_CALL_PARSERS) == TOOL_CALL_PARSER_NAMES
    assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES
    assert ProxyConfig().tool_call_parser == "hermes" and ProxyConfig().reasoning_parser == "qwen3"


def test_an_unknown_name_is_a_one_line_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError) as error:
        ProxyConfig(tool_call_parser="mistral")
    assert str(error.value) == (
        "proxy.tool_call_parser='mistral' is not allowed: expected one of hermes, qwen25, qwen, qwen3_coder, llama3 "
        "(SGLang's parser names)"
    )
    with pytest.raises(ConfigError, match=r"proxy.reasoning_parser='qwen2' .* null or one of qwen3, qwen3-thinking"):
        ProxyConfig(reasoning_parser="qwen2")
    assert ProxyConfig(reasoning_parser=None).reasoning_parser is None
    assert ProxyConfig(tool_call_parser="llama3", reasoning_parser="none").tool_call_parser == "llama3"


# ----------------------------------------------------------------------------- hermes (qwen25, qwen)


HERMES_OUTPUT = (
    "Reading both.\n<tool_call>\n"
    '{"name": "read", "arguments": {"path": "a"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "read", "arguments": {"path": "b"}}\n</tool_call>'
)


@pytest.mark.parametrize("name", ["hermes", "qwen25", "qwen"])
def test_hermes_names_parse_qwen_and_compact_blocks_alike(name):
    output = assert_every_chunking_agrees(HERMES_OUTPUT, tool_call_parser=name)
    assert output == AssistantOutput(
        text="Reading both.",
        tool_calls=calls(("read", '{"path": "a"}'), ("read", '{"path": "b"}')),
        stop_reason="tool_calls",
    )
    compact = parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tool_call_parser=name)
    assert compact.tool_calls == calls(("f", "{}"))


def test_hermes_array_body_gives_every_call_or_none():
    body = '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"s": "]</tool_call>"}}]'
    output = assert_every_chunking_agrees(f"<tool_call>\n{body}\n</tool_call>")
    assert output.tool_calls == calls(("f", '{"a": 1}'), ("g", '{"s": "]</tool_call>"}'))
    bad = '<tool_call>[{"name": "f", "arguments": {}}, {"arguments": {}}]</tool_call>'
    assert parse(bad) == AssistantOutput(text=bad)
    assert parse("<tool_call>[]</tool_call>") == AssistantOutput(text="<tool_call>[]</tool_call>")


def test_a_call_returned_as_text_is_logged_with_the_parser_and_the_reason(caplog):
    caplog.set_level(logging.WARNING, logger=PARSER_LOG)
    text = 'Try.\n<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'
    assert parse(text, tool_call_parser="qwen25") == AssistantOutput(text=text)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "tool_call_parser=qwen25" in record.getMessage()
    assert '"arguments" is neither a JSON object nor a string holding one' in record.getMessage()
    caplog.clear()
    assert parse('<tool_call>{"name": "f"', "length").text == '<tool_call>{"name": "f"'
    assert "no </tool_call> before the end of the output" in caplog.records[0].getMessage()


def test_a_stray_quote_costs_its_own_call_not_the_later_ones():
    """Found in review: `"it"s"` flipped the JSON-string tracking, so no later `</tool_call>` closed the block and
    every later call of the output came back as text. The block now closes at the first `</tool_call>` skipped as
    inside a string when the body up to the tracked one does not parse, or when the output ends without one."""
    good = '<tool_call>\n{"name": "g", "arguments": {"n": 2}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "f", "arguments": {"q": "it"s"}}\n</tool_call>'
    for text in (f"Now.\n{bad}\n{good}\n{good}", f"{bad}\n{good}"):
        output = assert_every_chunking_agrees(text)
        assert [call.name for call in output.tool_calls] == ["g"] * text.count(good)
        assert bad in output.text
    # a `</tool_call>` that really is inside a string still does not close its block
    inside = '<tool_call>\n{"name": "echo", "arguments": {"s": "a</tool_call>b"}}\n</tool_call>'
    (call,) = assert_every_chunking_agrees(inside).tool_calls
    assert json.loads(call.arguments) == {"s": "a</tool_call>b"}


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "llama3"])
def test_thousands_of_malformed_calls_in_one_output_cost_two_short_log_lines(caplog, parser):
    """Found in review: one warning per malformed block let one output write thousands of lines, and a 200,000-
    character function name went into the log whole. The first is logged (reason and excerpt cut), the rest counted."""
    caplog.set_level(logging.WARNING, logger=PARSER_LOG)
    block = {
        "hermes": "<tool_call></tool_call>",
        "qwen3_coder": "<tool_call>\n<function=" + "A" * 200_000 + ">\nnot a parameter\n</tool_call>",
        "llama3": '<|python_tag|>{"name": 1}',
    }[parser]
    text = block * (3 if parser == "qwen3_coder" else 2000)
    assert parse(text, tool_call_parser=parser).tool_calls == ()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) <= 2 and all(len(message) < 600 for message in messages), [m[:200] for m in messages]
    if parser != "llama3":  # llama3 reads one run of calls after its tag: the rest is the first's text
        assert "more tool calls of this output returned as text" in messages[-1]


# ----------------------------------------------------------------------------- llama3


LLAMA_OUTPUT = (
    'Checking.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "note": "{not} a \\"brace\\""}}; '
    '{"name": "get_time", "arguments": {}}\n\nBoth asked.'
)


def test_llama3_tagged_calls_with_text_before_and_after():
    output = assert_every_chunking_agrees(LLAMA_OUTPUT, tool_call_parser="llama3")
    assert output == AssistantOutput(
        text="Checking.\n\nBoth asked.",
        tool_calls=calls(
            ("get_weather", '{"city": "Paris", "note": "{not} a \\"brace\\""}'),
            ("get_time", "{}"),
        ),
        stop_reason="tool_calls",
    )


def test_llama3_bare_calls_at_the_start_separated_by_semicolons():
    text = '\n {"name": "a", "parameters": {"x": [1, {"y": 2}]}};{"name": "b", "parameters": {}};\n'
    output = assert_every_chunking_agrees(text, tool_call_parser="llama3")
    assert output == AssistantOutput(
        tool_calls=calls(("a", '{"x": [1, {"y": 2}]}'), ("b", "{}")), stop_reason="tool_calls"
    )
    after = parse('{"name": "a", "parameters": {}}; then text', tool_call_parser="llama3")
    assert after.text == "then text" and len(after.tool_calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        "The set {1, 2} has two elements.",  # does not start with a call
        'Use {"name": "f", "parameters": {}} like this.',  # a call object after text, without the tag
        '{"result": 5}',  # JSON that is no call
        '{"name": "f", "parameters": [1]}',
        '<|python_tag|>brave_search.call(query="x")',  # a built-in tool's Python call
        "<|python_tag|>",
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}',  # unterminated
        '{"name": "f", "parameters": {"a": NaN}}',
    ],
)
def test_llama3_what_is_no_call_is_text(text, caplog):
    caplog.set_level(logging.WARNING, logger=PARSER_LOG)
    output = assert_every_chunking_agrees(text, tool_call_parser="llama3")
    assert output == AssistantOutput(text=text.strip())
    if text.startswith(("{", "<|python_tag|>")):
        assert all("tool_call_parser=llama3" in r.getMessage() for r in caplog.records) and caplog.records


def test_llama3_a_bad_object_after_a_call_is_text_with_what_follows():
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"nom": "b"}; {"name": "c", "parameters": {}}'
    output = parse(text, tool_call_parser="llama3")
    assert output.tool_calls == calls(("a", "{}"))
    assert output.text == '{"nom": "b"}; {"name": "c", "parameters": {}}'


def test_llama3_a_later_tag_starts_another_run():
    text = 'x <|python_tag|>oops <|python_tag|>{"name": "f", "parameters": {}}'
    output = parse(text, tool_call_parser="llama3")
    assert output.text == "x <|python_tag|>oops" and output.tool_calls == calls(("f", "{}"))


# ----------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize("name", ["qwen3-thinking", "deepseek-r1"])
def test_forced_reasoning_starts_inside_thinking_and_drops_a_written_open_tag(name):
    for text in (
        "\nPlan it.\n</think>\n\nDone.",
        "<think>\nPlan it.\n</think>\n\nDone.",
        " <think>Plan it.</think>Done.",
    ):
        output = assert_every_chunking_agrees(text, reasoning_parser=name)
        assert (output.thinking, output.text) == ("Plan it.", "Done.")
    assert parse("never closes", "length", reasoning_parser=name) == AssistantOutput(
        thinking="never closes", stop_reason="length"
    )


def test_qwen3_thinks_only_when_the_output_or_the_prompt_opens_it():
    assert parse("answer </think> x").text == "answer </think> x"
    opened = parse("\nthink\n</think>\n\nanswer", starts_in_thinking=True)
    assert (opened.thinking, opened.text) == ("think", "answer")
    assert parse("<think>\nthink</think>answer", starts_in_thinking=True).thinking == "think"


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("qwen3", "<|im_start|>assistant\n")
    assert not prompt_opens_thinking("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not prompt_opens_thinking(None, "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("none", "<think>")


def test_reasoning_and_tool_calls_stream_in_order():
    text = '<think>\nneed a tool\n</think>\n\n<|python_tag|>{"name": "f", "parameters": {"q": 1}}'
    events, output = run_parser(list(text), tool_call_parser="llama3")
    assert [type(e) for e in merge(events)] == [ThinkingDelta, ToolCallDone]
    assert output.thinking == "need a tool" and output.tool_calls == calls(("f", '{"q": 1}'))


# ----------------------------------------------------------------------------- every dialect: properties

_PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=f>",
    "<function=",
    "</function>",
    "<parameter=p>",
    "<parameter=n>",
    "</parameter>",
    "<|python_tag|>",
    "<|py",
    "<",
    "</",
    ">",
    "\n",
    " ",
    ";",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ":",
    ",",
    '"name"',
    '"parameters"',
    '{"a": 1}',
    '{"name": "f", "arguments": {"x": "</tool_call>"}}',
    '{"name": "g", "parameters": {"y": "}{"}}',
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>",
    '<|python_tag|>{"name": "h", "parameters": {}};',
    "<think>\nhm\n</think>\n\n",
    "42",
    "null",
    "hello",
    "世界",
    "😀",
]
output_texts = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=5)), max_size=30).map("".join)
TOOLS = (ToolSpec(name="f", parameters={"type": "object", "properties": {"n": {"type": "integer"}}}),)


@pytest.mark.parametrize("reasoning_parser", ["qwen3", "deepseek-r1", None])
@pytest.mark.parametrize("tool_call_parser", ["hermes", "qwen3_coder", "llama3"])
@settings(max_examples=120, deadline=None)
@given(
    text=output_texts,
    cuts=st.lists(st.integers(0, 400), max_size=12),
    engine_finish=st.sampled_from(["stop", "length", "abort"]),
    starts_in_thinking=st.booleans(),
)
def test_any_chunking_gives_the_events_of_the_whole_text(
    tool_call_parser, reasoning_parser, text, cuts, engine_finish, starts_in_thinking
):
    options = {
        "tool_call_parser": tool_call_parser,
        "reasoning_parser": reasoning_parser,
        "tools": TOOLS,
        "starts_in_thinking": starts_in_thinking,
    }
    whole_events, whole_output = run_parser([text], engine_finish, **options)
    events, output = run_parser(split_at(text, cuts), engine_finish, **options)
    assert merge(events) == merge(whole_events)
    assert output == whole_output
    assert_output_is_merge(events, output)
    assert output.text == output.text.strip()
    for call in output.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


# ----------------------------------------------------------------------------- through the decoder: token ids

TOKENIZED = {
    "hermes": (
        'Let me — 看看.\n<tool_call>\n{"name": "read", "arguments": {"path": "日本/a.txt", "n": 2}}\n</tool_call>'
    ),
    "qwen3_coder": (
        "Let me — 看看.\n<tool_call>\n<function=read>\n<parameter=path>\n日本/a.txt\n</parameter>\n"
        "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"
    ),
    "llama3": 'Let me — 看看.<|python_tag|>{"name": "read", "parameters": {"path": "日本/a.txt", "n": 2}}',
}
READ_TOOL = ToolSpec(
    name="read", parameters={"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}
)


@pytest.mark.parametrize("tool_call_parser", sorted(TOKENIZED))
def test_every_dialect_through_the_decoder_at_any_id_chunking(tool_call_parser):
    tok = tiny_tokenizer()
    ids = tok.encode(TOKENIZED[tool_call_parser], add_special_tokens=False).ids
    rng = random.Random(0)
    reference = None
    for trial in range(20):
        decoder = OutputDecoder(tok, new_call_id=ids_counter(), tool_call_parser=tool_call_parser, tools=(READ_TOOL,))
        events, i = [], 0
        while i < len(ids):
            step = 1 if trial == 0 else rng.randint(1, 6)
            events += decoder.feed(ids[i : i + step])
            i += step
        more, output = decoder.finish("stop")
        events += more
        assert output.text == "Let me — 看看." and output.stop_reason == "tool_calls"
        (call,) = output.tool_calls
        assert (call.name, json.loads(call.arguments)) == ("read", {"path": "日本/a.txt", "n": 2})
        assert_output_is_merge(events, output)
        reference = reference or merge(events)
        assert merge(events) == reference
        assert isinstance(merge(events)[0], TextDelta)
