"""The dialects' field-checking kit: one message shape (path, what was got, what is allowed) in each spelling."""

from __future__ import annotations

import pytest

from gyre.proxy.conversation import ApiError
from gyre.proxy.dialects import anthropic, openai_chat
from gyre.proxy.dialects.fields import header_signals, json_type, nesting_depth_exceeds

ANTHROPIC, OPENAI = anthropic.check, openai_chat.check


def message(check, call, *args, **kwargs) -> tuple[str, str | None]:
    with pytest.raises(ApiError) as caught:
        getattr(check, call)(*args, **kwargs)
    assert caught.value.kind == "invalid_request" and caught.value.status == 400
    return caught.value.message, caught.value.param


@pytest.mark.parametrize(
    ("call", "args", "kwargs", "anthropic_message", "openai_message"),
    [
        ("string", (None, "model"), {}, "model: expected a string, got null", "model must be a string, got null"),
        ("string", ("", "m"), {"non_empty": True}, "m: must be a non-empty string", "m: must be a non-empty string"),
        ("string", ("\ud800", "t"), {}, "t: string is not valid Unicode (a lone surrogate)", None),
        (
            "object",
            ([], "tools.0"),
            {},
            "tools.0: expected an object, got array",
            "tools.0 must be an object, got array",
        ),
        ("array", (3, "a"), {}, "a: expected an array, got integer", "a must be an array, got integer"),
        ("optional_bool", ("yes", "stream"), {}, "stream: expected a boolean, got string", None),
        ("optional_int", (1.5, "n"), {"low": 1}, "n: expected an integer, got number", None),
        ("optional_int", (True, "n"), {"low": 1}, "n: expected an integer, got boolean", None),
        ("optional_int", (0, "n"), {"low": 1}, "n: must be >= 1, got 0", "n: must be at least 1, got 0"),
        (
            "optional_number",
            (float("nan"), "t"),
            {"low": 0.0, "high": 2.0},
            "t: must be between 0.0 and 2.0, got nan",
            None,
        ),
        ("optional_number", (3, "t"), {"low": 0.0, "high": 2.0}, "t: must be between 0.0 and 2.0, got 3", None),
        (
            "choice",
            ("x", "r", ("a", "b", "c")),
            {},
            "r: expected 'a', 'b' or 'c', got 'x'",
            "r must be one of 'a', 'b' or 'c', got 'x'",
        ),
        (
            "choice",
            (None, "r", ("a",)),
            {"where": "here"},
            "r: expected 'a' here, got None",
            "r must be one of 'a' here, got None",
        ),
        (
            "json_text",
            ({"x": float("inf")}, "s"),
            {},
            "s: must be strict JSON: no NaN, Infinity or lone surrogates",
            None,
        ),
    ],
)
def test_one_message_shape_in_each_spelling(call, args, kwargs, anthropic_message, openai_message):
    path = args[1]
    assert message(ANTHROPIC, call, *args, **kwargs) == (anthropic_message, path)
    if openai_message is not None:
        assert message(OPENAI, call, *args, **kwargs) == (openai_message, path)


def test_checks_return_what_they_accept():
    assert ANTHROPIC.optional_number(1, "t", low=0.0, high=2.0) == 1.0 and ANTHROPIC.optional_int(None, "n") is None
    assert OPENAI.choice("b", "r", ("a", "b")) == "b" and OPENAI.optional_object(None, "o") is None
    assert ANTHROPIC.json_text({"a": [1, "é"]}, "s") == '{"a":[1,"é"]}'
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert message(OPENAI, "json_text", deep, "s") == ("s: is nested too deeply", "s")


def test_json_types_and_header_signals():
    assert [json_type(v) for v in (None, True, 1, 1.0, "", [], {})] == [
        "null",
        "boolean",
        "integer",
        "number",
        "string",
        "array",
        "object",
    ]
    headers = {"User-Agent": "codex", "X-Other": "1"}
    assert header_signals(headers, ("user-agent", "x-gyre-role")) == {"user-agent": "codex"}


def test_nesting_depth_counts_containers_level_by_level_without_recursion():
    deep: list = []
    node = deep
    for _ in range(100_000):  # far deeper than any recursive walk could go
        node.append([])
        node = node[0]
    assert nesting_depth_exceeds(deep, 128)
    assert not nesting_depth_exceeds({"a": [1, {"b": "x" * 1000}]}, 3)
    assert nesting_depth_exceeds({"a": [1, {"b": []}]}, 3)
    assert not nesting_depth_exceeds("text", 0) and not nesting_depth_exceeds([], 1) and nesting_depth_exceeds([[]], 1)
