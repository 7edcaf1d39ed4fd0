"""gyre.proxy.parsers.qwen3_coder: Qwen3-Coder's `<function=...>`/`<parameter=...>` calls, typed by the tool schema."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_proxy_output import ids_counter, run_parser, split_at
from test_proxy_parsers import PARSER_LOG, assert_every_chunking_agrees, calls

from gyre.proxy.conversation import AssistantOutput, ToolSpec
from gyre.proxy.output import parse_output
from gyre.proxy.parsers.qwen3_coder import convert_value, schema_properties, schema_type

SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "limit": {"type": "integer"},
        "ratio": {"type": "number"},
        "whole": {"type": "number"},
        "recursive": {"type": "boolean"},
        "options": {"type": "object"},
        "globs": {"type": "array", "items": {"type": "string"}},
        "depth": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    },
}
TOOLS = (ToolSpec(name="search", parameters=SCHEMA), ToolSpec(name="run", parameters={"type": "object"}))


def call_text(name: str, parameters: dict[str, str]) -> str:
    """A call as Qwen3-Coder's chat template renders it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(text: str, engine_finish: str = "stop", tools=TOOLS) -> AssistantOutput:
    return parse_output(text, engine_finish, new_call_id=ids_counter(), tool_call_parser="qwen3_coder", tools=tools)


def arguments(output: AssistantOutput) -> list[dict]:
    return [json.loads(call.arguments) for call in output.tool_calls]


def test_parameters_are_typed_by_the_request_schema():
    raw = {
        "path": "007",
        "limit": "40",
        "ratio": "0.5",
        "whole": "3",
        "recursive": "True",
        "options": '{"case": false, "n": [1, 2]}',
        "globs": '["*.py", "*.md"]',
        "depth": "null",
    }
    text = "Searching now.\n" + call_text("search", raw)
    output = assert_every_chunking_agrees(text, tool_call_parser="qwen3_coder", tools=TOOLS)
    assert output.text == "Searching now." and output.stop_reason == "tool_calls"
    assert output.tool_calls[0].arguments == (
        '{"path": "007", "limit": 40, "ratio": 0.5, "whole": 3, "recursive": true, '
        '"options": {"case": false, "n": [1, 2]}, "globs": ["*.py", "*.md"], "depth": null}'
    )


def test_values_that_do_not_convert_and_undeclared_parameters_stay_text():
    raw = {"limit": "forty", "ratio": "nan", "recursive": "yes", "options": "{bad", "path": "null", "extra": "12"}
    (args,) = arguments(parse(call_text("search", raw)))
    assert args == raw
    (args,) = arguments(parse(call_text("not_offered", {"n": "1"})))  # a tool the request did not offer
    assert args == {"n": "1"}
    assert arguments(parse(call_text("run", {"n": "1"}))) == [{"n": "1"}]  # a schema without properties


def test_values_are_verbatim_but_for_one_newline_at_each_end():
    code = "\ndef f(a, b):\n    return a < b and b > 0  # <not a tag>\n\n"
    (args,) = arguments(parse(call_text("run", {"code": code, "empty": ""})))
    assert args == {"code": code, "empty": ""}


def test_several_calls_in_blocks_and_in_one_block_with_text_around():
    one_block = (
        "<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n</function>\n"
        "<function=run>\n<parameter=cmd>\npwd\n</parameter>\n</function>\n</tool_call>"
    )
    text = f"First.\n{call_text('search', {'limit': '1'})}\nThen.\n{one_block}\n"
    output = assert_every_chunking_agrees(text, tool_call_parser="qwen3_coder", tools=TOOLS)
    assert output.text == "First.\n\nThen."
    assert output.tool_calls == calls(("search", '{"limit": 1}'), ("run", '{"cmd": "ls"}'), ("run", '{"cmd": "pwd"}'))


def test_missing_closing_tags_are_read_as_sglang_reads_them():
    text = "<tool_call>\n<function=run>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>\n</tool_call>"
    assert arguments(parse(text)) == [{"a": "x", "b": "y"}]
    text = "<tool_call>\n<function=run>\n<parameter=a>\nx\n</parameter>\n</tool_call>"  # no </function>
    assert arguments(parse(text)) == [{"a": "x"}]
    assert arguments(parse("<tool_call><function=run></function></tool_call>")) == [{}]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("", "no <function=NAME> in the block"),
        ('\n{"name": "run", "arguments": {}}\n', "expected <function=NAME>"),
        ("\n<function=>\n</function>\n", "<function=... without a name"),
        ("\n<function=run\n</function>\n", "<function=... without a name"),
        ("\n<function=run>\nstray words\n<parameter=a>\n1\n</parameter>\n</function>\n", "unexpected text"),
        ("\n<function=run>\n<parameter=>\n1\n</parameter>\n</function>\n", "<parameter=... without a name"),
        ("\n<function=run>\n</function>\ntrailing\n", "expected <function=NAME>"),
    ],
)
def test_a_body_that_breaks_the_grammar_is_text_and_logged(body, reason, caplog):
    caplog.set_level(logging.WARNING, logger=PARSER_LOG)
    text = f"Calling.\n<tool_call>{body}</tool_call>"
    output = parse(text)
    assert output == AssistantOutput(text=text)
    (record,) = caplog.records
    assert "tool_call_parser=qwen3_coder" in record.getMessage() and reason in record.getMessage()


def test_unterminated_block_is_text_at_finish(caplog):
    caplog.set_level(logging.WARNING, logger=PARSER_LOG)
    text = "Calling.\n<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n</function>\n"
    for chunks in ([text], list(text)):
        _, output = run_parser(chunks, "length", tool_call_parser="qwen3_coder")
        assert output == AssistantOutput(text=text.strip(), stop_reason="length")
    assert "no </tool_call> before the end of the output" in caplog.records[0].getMessage()


def test_streaming_holds_a_split_tag_and_releases_plain_angles():
    _, output = run_parser(["a < b <tool", "_call>\n<function=run>\n</function>\n</tool", "_call> c"])
    assert output.text == "a < b <tool_call>\n<function=run>\n</function>\n</tool_call> c"  # hermes: not JSON
    _, output = run_parser(
        ["a < b <tool", "_call>\n<function=run>\n</function>\n</tool", "_call> c"], tool_call_parser="qwen3_coder"
    )
    assert output.text == "a < b  c" and output.tool_calls == calls(("run", "{}"))


# ----------------------------------------------------------------------------- schema types


@pytest.mark.parametrize(
    ("schema", "kind"),
    [
        ({"type": "Integer"}, "integer"),
        ({"type": ["null", "number"]}, "number"),
        ({"type": ["null"]}, "string"),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "integer"),
        ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "string"),
        ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "integer"),
        ({"enum": [1, 2]}, "integer"),
        ({"enum": ["a", 1]}, "string"),
        ({"enum": []}, "string"),
        ({"allOf": [{"description": "x"}, {"type": "array"}]}, "array"),
        ({"properties": {}}, "object"),
        ({"items": {}}, "array"),
        ({"description": "anything"}, None),
        ("not a schema", None),
    ],
)
def test_schema_type(schema, kind):
    assert schema_type(schema) == kind


def test_schema_properties_descend_into_unions():
    assert schema_properties({"oneOf": [{"properties": {"a": {}}}, {"properties": {"b": {}, "a": {"type": "x"}}}]}) == {
        "a": {},
        "b": {},
    }
    assert schema_properties({"type": "object"}) == {} and schema_properties(None) == {}


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("12", "integer", 12),
        ("1e3", "number", 1000.0),
        ("-7", "number", -7),
        ("inf", "number", "inf"),
        ("9" * 5000, "integer", "9" * 5000),  # past Python's int-string limit: stays text
        ("FALSE", "boolean", False),
        ("Null", "integer", None),
        ("null", "string", "null"),
        ("[" * 10_000, "array", "[" * 10_000),
        ("42", None, "42"),
        ("42", "weird-type", "42"),
    ],
)
def test_convert_value(text, kind, value):
    assert convert_value(text, kind) == value


# ----------------------------------------------------------------------------- properties

_FORBIDDEN = ("</parameter>", "<parameter=", "</function>", "</tool_call>", "<function=")
values = st.text(max_size=30).filter(lambda v: not any(tag in v for tag in _FORBIDDEN))
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(
    parameters=st.dictionaries(names, values, max_size=4),
    text=st.text(max_size=20).filter(lambda t: "<tool_call>" not in t),
    cuts=st.lists(st.integers(0, 300), max_size=8),
)
def test_string_parameters_round_trip_at_any_chunking(parameters, text, cuts):
    output_text = f"{text}\n{call_text('tool', parameters)}"
    tools = (ToolSpec(name="tool", parameters={"properties": {k: {"type": "string"} for k in parameters}}),)
    _, output = run_parser(
        split_at(output_text, cuts), tool_call_parser="qwen3_coder", tools=tools, reasoning_parser=None
    )
    assert arguments(output) == [parameters]
    assert output.text == text.strip()


def test_thousands_of_values_without_their_closing_tag_are_read_in_one_pass():
    """Found in review: each value without `</parameter>` searched the rest of the body for it, so 4,096 such values
    took 3.5 s on the event loop (169 s at 16,384). Each tag is now searched once per occurrence; the values are
    as before (each cut at the next `<parameter=`)."""
    n = 20_000
    values = "".join(f"<parameter=p{i}>{i}" for i in range(n))
    text = "<tool_call>\n<function=f>\n" + values + "\n</function>\n</tool_call>"
    (call,) = parse(text).tool_calls
    arguments = json.loads(call.arguments)
    assert len(arguments) == n and arguments["p0"] == "0" and arguments[f"p{n - 1}"] == str(n - 1)
