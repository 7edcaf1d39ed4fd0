"""The Anthropic Messages dialect against what Claude Code sends and what the real `anthropic` SDK accepts."""

from __future__ import annotations

import copy
import json

import anthropic
import httpx2 as httpx  # the HTTP client anthropic 2.x is built on
import pytest
from anthropic.types import Message, ModelInfo, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from gyre.proxy.conversation import (
    ApiError,
    AssistantOutput,
    ChatRequest,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallDone,
    ToolSpec,
    Turn,
    Usage,
)
from gyre.proxy.dialects import anthropic as dialect

CACHE = {"type": "ephemeral"}
BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
    "required": ["command"],
}
READ_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}
TODO_SCHEMA = {"type": "object", "properties": {"todos": {"type": "array", "items": {"type": "object"}}}}
HEADERS = {
    "Anthropic-Version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
    "X-Claude-Code-Session-Id": "sess-1",
    "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)",
    "x-api-key": "secret",
}


def claude_code_body() -> dict:
    """A second-turn request shaped like Claude Code's (docs/harness.md), trimmed to three tools. A fresh copy."""
    body = {
        "model": "gyre-tiny",
        "max_tokens": 32000,
        "stream": True,
        "thinking": {"type": "adaptive"},
        "metadata": {"user_id": "user_abc_account__session_sess-1"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": "You are an interactive CLI tool.", "cache_control": CACHE},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>\nAs you answer, use this context.\n</system-reminder>"},
                    {"type": "text", "text": "List the files, then read main.py", "cache_control": CACHE},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should run ls.", "signature": "c2lnbmF0dXJl"},
                    {"type": "text", "text": "Listing the files."},
                    {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls", "timeout": 5}},
                    {"type": "tool_use", "id": "toolu_02", "name": "Read", "input": {"file_path": "/w/main.py"}},
                ],
            },
            {"role": "system", "content": "<system-reminder>Agents available: general-purpose</system-reminder>"},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": "main.py\nREADME.md",
                        "is_error": False,
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_02",
                        "content": [{"type": "text", "text": "print('hi')"}, {"type": "text", "text": "# end"}],
                        "is_error": True,
                        "cache_control": CACHE,
                    },
                    {"type": "text", "text": "Now explain it."},
                ],
            },
        ],
        "tools": [
            {"name": "Bash", "description": "Run a shell command.", "input_schema": BASH_SCHEMA},
            {"name": "Read", "description": "Read a file.", "input_schema": READ_SCHEMA, "cache_control": CACHE},
            {"name": "TodoWrite", "input_schema": TODO_SCHEMA},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
    }
    return copy.deepcopy(body)  # shares nothing with the module constants, whatever a test mutates


EXPECTED = ChatRequest(
    dialect="anthropic",
    model="gyre-tiny",
    system="You are Claude Code, Anthropic's official CLI for Claude.\n\nYou are an interactive CLI tool.",
    turns=(
        Turn(
            role="user",
            text="<system-reminder>\nAs you answer, use this context.\n</system-reminder>"
            "\n\nList the files, then read main.py",
        ),
        Turn(
            role="assistant",
            text="Listing the files.",
            thinking="I should run ls.",
            tool_calls=(
                ToolCall(id="toolu_01", name="Bash", arguments='{"command":"ls","timeout":5}'),
                ToolCall(id="toolu_02", name="Read", arguments='{"file_path":"/w/main.py"}'),
            ),
        ),
        Turn(role="system", text="<system-reminder>Agents available: general-purpose</system-reminder>"),
        Turn(role="tool", tool_call_id="toolu_01", text="main.py\nREADME.md"),
        Turn(role="tool", tool_call_id="toolu_02", text="print('hi')\n\n# end", is_error=True),
        Turn(role="user", text="Now explain it."),
    ),
    tools=(
        ToolSpec(name="Bash", description="Run a shell command.", parameters=BASH_SCHEMA),
        ToolSpec(name="Read", description="Read a file.", parameters=READ_SCHEMA),
        ToolSpec(name="TodoWrite", description="", parameters=TODO_SCHEMA),
    ),
    stream=True,
    max_tokens=32000,
    thinking=True,
    signals={
        "x-claude-code-session-id": "sess-1",
        "user-agent": "claude-cli/2.1.197 (external, sdk-cli)",
    },
    echo={"metadata": {"user_id": "user_abc_account__session_sess-1"}},
)


def parse(body) -> ChatRequest:
    return dialect.parse_request(body, HEADERS, {"beta": "true"})


# ----------------------------------------------------------------------------- parsing


def test_claude_code_request_parses_to_the_canonical_request():
    assert parse(claude_code_body()) == EXPECTED


def test_cache_control_and_signatures_do_not_change_the_parse():
    body = claude_code_body()
    for message in body["messages"]:
        if isinstance(message["content"], list):
            for block in message["content"]:
                block.pop("cache_control", None)
                if block["type"] == "thinking":
                    block["signature"] = "another"
    body["messages"][-1]["content"][-1]["cache_control"] = CACHE
    body["system"][1].pop("cache_control")
    assert parse(body) == EXPECTED


def test_sampling_fields_and_agent_header():
    body = claude_code_body()
    body.update(temperature=0.7, top_p=0.9, top_k=40, stop_sequences=["</done>"], thinking={"type": "disabled"})
    body["system"] = "plain system"
    headers = {"x-claude-code-agent-id": "agent-7", "X-Claude-Code-Session-Id": "sess-1"}
    request = dialect.parse_request(body, headers, {})
    assert (request.temperature, request.top_p, request.top_k, request.stop) == (0.7, 0.9, 40, ("</done>",))
    assert request.thinking is False
    assert request.system == "plain system"
    assert request.signals == {"x-claude-code-session-id": "sess-1", "x-claude-code-agent-id": "agent-7"}


def test_minimal_request_defaults():
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    request = dialect.parse_request(body, {}, {})
    assert request == ChatRequest(
        dialect="anthropic", model="m", system=None, turns=(Turn(role="user", text="hi"),), max_tokens=1
    )


def test_user_message_splits_into_runs_in_block_order():
    body = claude_code_body()
    body["messages"][3]["content"] = [
        {"type": "text", "text": "before"},
        {"type": "tool_result", "tool_use_id": "toolu_01"},
        {"type": "text", "text": "middle"},
        {"type": "text", "text": "more"},
        {"type": "tool_result", "tool_use_id": "toolu_02", "content": []},
    ]
    assert parse(body).turns[3:] == (
        Turn(role="user", text="before"),
        Turn(role="tool", tool_call_id="toolu_01", text=""),
        Turn(role="user", text="middle\n\nmore"),
        Turn(role="tool", tool_call_id="toolu_02", text=""),
    )


def test_redacted_thinking_is_ignored():
    body = claude_code_body()
    body["messages"][1]["content"].insert(0, {"type": "redacted_thinking", "data": "opaque"})
    assert parse(body) == EXPECTED


def test_count_tokens_does_not_need_max_tokens():
    body = claude_code_body()
    del body["max_tokens"], body["stream"]
    request = dialect.parse_count_tokens(body, HEADERS, {})
    assert request.max_tokens is None and request.turns == EXPECTED.turns
    with pytest.raises(ApiError, match=r"^max_tokens: field required"):
        parse(body)
    assert dialect.count_tokens_body(1234) == {"input_tokens": 1234}


def _set(body: dict, path: tuple, value) -> dict:
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


DELETE = object()
BAD_INPUTS = [
    ((), None, "body: expected an object, got array"),
    (("model",), DELETE, "model: expected a string, got null"),
    (("model",), 3, "model: expected a string, got integer"),
    (("model",), "", "model: must be a non-empty string"),
    (("max_tokens",), DELETE, "max_tokens: field required"),
    (("max_tokens",), 0, "max_tokens: must be >= 1"),
    (("max_tokens",), 10.5, "max_tokens: expected an integer, got number"),
    (("max_tokens",), True, "max_tokens: expected an integer, got boolean"),
    (("temperature",), "hot", "temperature: expected a number, got string"),
    (("temperature",), float("nan"), "temperature: must be between"),
    (("top_p",), 1.5, "top_p: must be between"),
    (("top_k",), -1, "top_k: must be >= 0"),
    (("stream",), "yes", "stream: expected a boolean, got string"),
    (("stop_sequences",), "</done>", "stop_sequences: expected an array, got string"),
    (("stop_sequences",), ["ok", 1], "stop_sequences.1: expected a string, got integer"),
    (("thinking",), {"type": "sometimes"}, "thinking.type: expected 'enabled', 'adaptive' or 'disabled'"),
    (("thinking",), True, "thinking: expected an object, got boolean"),
    (("system",), 5, "system: expected an array, got integer"),
    (("system", 1, "type"), "image", "system.1.type: image input is not supported by this model"),
    (("system", 0, "text"), None, "system.0.text: expected a string, got null"),
    (("messages",), DELETE, "messages: expected an array, got null"),
    (("messages",), [], "messages: at least one message is required"),
    (("messages", 0), "hi", "messages.0: expected an object, got string"),
    (("messages", 0, "role"), "developer", "messages.0.role: expected 'user', 'assistant' or 'system'"),
    (("messages", 0, "content"), DELETE, "messages.0.content: field required"),
    (("messages", 0, "content"), 7, "messages.0.content: expected an array, got integer"),
    (("messages", 0, "content", 1, "type"), DELETE, "messages.0.content.1.type: expected a string, got null"),
    (("messages", 0, "content", 1, "type"), "video", "messages.0.content.1.type: expected 'text' or 'tool_result'"),
    (("messages", 0, "content", 1), {"type": "image", "source": {}}, "messages.0.content.1.type: image input is not"),
    (("messages", 0, "content", 1), {"type": "document"}, "messages.0.content.1.type: image input is not supported"),
    (("messages", 0, "content", 0, "text"), "\ud800", "messages.0.content.0.text: string is not valid Unicode"),
    (("messages", 1, "content", 0, "thinking"), 1, "messages.1.content.0.thinking: expected a string"),
    (("messages", 1, "content", 2, "id"), "", "messages.1.content.2.id: must be a non-empty string"),
    (("messages", 1, "content", 2, "name"), None, "messages.1.content.2.name: expected a string, got null"),
    (("messages", 1, "content", 2, "input"), "ls", "messages.1.content.2.input: expected an object, got string"),
    (("messages", 1, "content", 2, "input"), {"x": float("inf")}, "messages.1.content.2.input: must be strict JSON"),
    (("messages", 1, "content", 0, "type"), "tool_result", "messages.1.content.0.type: expected 'text', 'thinking'"),
    (("messages", 2, "content"), [{"type": "tool_result"}], "messages.2.content.0.type: expected 'text', got"),
    (("messages", 3, "content", 0, "tool_use_id"), 5, "messages.3.content.0.tool_use_id: expected a string"),
    (
        ("messages", 3, "content", 0, "tool_use_id"),
        "toolu_99",
        "messages.3.content.0.tool_use_id: 'toolu_99' matches no",
    ),
    (("messages", 3, "content", 0, "is_error"), "no", "messages.3.content.0.is_error: expected a boolean"),
    (("messages", 3, "content", 0, "content"), 3, "messages.3.content.0.content: expected an array, got integer"),
    (("messages", 3, "content", 1, "content", 0), {"type": "image"}, "messages.3.content.1.content.0.type: image"),
    (("messages", 3, "content", 2, "type"), "tool_use", "messages.3.content.2.type: expected 'text' or 'tool_result'"),
    (("tools",), {"name": "Bash"}, "tools: expected an array, got object"),
    (("tools", 0, "name"), DELETE, "tools.0.name: expected a string, got null"),
    (("tools", 1, "input_schema"), "object", "tools.1.input_schema: expected an object, got string"),
    (("tools", 2, "description"), 3, "tools.2.description: expected a string, got integer"),
    (("tools", 3, "type"), 3, "tools.3.type: expected a string, got integer"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD_INPUTS, ids=[m.split(":")[0] for _, _, m in BAD_INPUTS])
def test_bad_input_is_an_invalid_request_naming_the_field(path, value, message):
    body = [] if path == () else _set(claude_code_body(), path, value)
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert caught.value.kind == "invalid_request" and caught.value.status == 400
    assert caught.value.message.startswith(message), caught.value.message
    assert caught.value.param == message.split(":")[0]


def test_a_tool_result_must_answer_an_earlier_tool_use():
    body = claude_code_body()
    body["messages"] = [body["messages"][3], *body["messages"][:3]]
    with pytest.raises(ApiError, match=r"^messages\.0\.content\.0\.tool_use_id: 'toolu_01' matches no tool_use"):
        parse(body)


# ----------------------------------------------------------------------------- responses

OUTPUT = AssistantOutput(
    thinking="Let me look.",
    text="Reading it now.",
    tool_calls=(
        ToolCall(id="toolu_a1", name="Read", arguments='{"file_path": "/w/main.py"}'),
        ToolCall(id="toolu_a2", name="Bash", arguments='{"command":"ls -la"}'),
    ),
    stop_reason="tool_calls",
)
USAGE = Usage(input_tokens=1200, output_tokens=57, cached_tokens=1000)
USAGE_JSON = {
    "input_tokens": 200,
    "output_tokens": 57,
    "cache_read_input_tokens": 1000,
    "cache_creation_input_tokens": 0,
}


def test_response_body_is_an_sdk_message():
    body = dialect.response_body(EXPECTED, OUTPUT, USAGE, message_id="msg_01")
    message = Message.model_validate(body)
    assert message.model_dump(exclude_unset=True) == body  # every field we send is a field of the type
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[0].signature == dialect.thinking_signature("Let me look.")
    assert message.content[2].input == {"file_path": "/w/main.py"}
    assert (message.id, message.model, message.stop_reason, message.stop_sequence) == (
        "msg_01",
        "gyre-tiny",
        "tool_use",
        None,
    )
    assert body["usage"] == USAGE_JSON


def test_thinking_signature_is_deterministic_and_opaque():
    assert dialect.thinking_signature("a") == dialect.thinking_signature("a") != dialect.thinking_signature("b")


def test_echoed_response_parses_back_to_the_same_assistant_turn():
    body = claude_code_body()
    answer = dialect.response_body(EXPECTED, OUTPUT, USAGE, message_id="msg_01")
    body["messages"].append({"role": "assistant", "content": answer["content"]})
    assert parse(body).turns[-1] == Turn(
        role="assistant",
        text="Reading it now.",
        thinking="Let me look.",
        tool_calls=(
            ToolCall(id="toolu_a1", name="Read", arguments='{"file_path":"/w/main.py"}'),
            ToolCall(id="toolu_a2", name="Bash", arguments='{"command":"ls -la"}'),
        ),
    )


@pytest.mark.parametrize(
    ("stop", "calls", "expected"),
    [
        ("stop", False, "end_turn"),
        ("length", False, "max_tokens"),
        ("abort", False, "end_turn"),
        ("stop", True, "tool_use"),
    ],
)
def test_stop_reasons(stop, calls, expected):
    output = AssistantOutput(text="x", tool_calls=OUTPUT.tool_calls if calls else (), stop_reason=stop)
    assert dialect.response_body(EXPECTED, output, USAGE, message_id="m")["stop_reason"] == expected


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '{"a": NaN}', ""])
def test_unparseable_tool_arguments_become_empty_input(arguments):
    output = AssistantOutput(tool_calls=(ToolCall(id="t", name="Bash", arguments=arguments),), stop_reason="tool_calls")
    body = dialect.response_body(EXPECTED, output, USAGE, message_id="m")
    assert body["content"] == [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]
    Message.model_validate(body)


def test_empty_output_has_no_content_blocks():
    body = dialect.response_body(EXPECTED, AssistantOutput(), USAGE, message_id="m")
    assert Message.model_validate(body).content == []


# ----------------------------------------------------------------------------- streaming

EVENTS = [
    ThinkingDelta("Let me"),
    ThinkingDelta(""),
    ThinkingDelta(" look."),
    TextDelta("Reading"),
    TextDelta(" it now."),
    ToolCallDone(OUTPUT.tool_calls[0]),
    ToolCallDone(OUTPUT.tool_calls[1]),
]


def split_sse(data: bytes) -> list[tuple[str, dict]]:
    frames = []
    for frame in data.decode().split("\n\n"):
        if frame:
            event_line, data_line = frame.split("\n")
            assert event_line.startswith("event: ") and data_line.startswith("data: ")
            frames.append((event_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    assert data.endswith(b"\n\n")
    return frames


def streamed() -> bytes:
    writer = dialect.StreamWriter(EXPECTED, message_id="msg_01", input_tokens=1200)
    chunks = [writer.start(), *(writer.event(ev) for ev in EVENTS), writer.finish(OUTPUT, USAGE)]
    return b"".join(chunks)


def test_stream_events_are_sdk_events_in_api_order():
    adapter = TypeAdapter(RawMessageStreamEvent)
    frames = split_sse(streamed())
    assert all(name == data["type"] for name, data in frames)
    assert frames[1] == ("ping", {"type": "ping"})
    events = [adapter.validate_python(data) for name, data in frames if name != "ping"]
    shape = [(e.type, getattr(e, "index", None), getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert shape == [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, None),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[11].delta.partial_json == '{"file_path": "/w/main.py"}'  # the model's own bytes
    assert events[16].delta.stop_reason == "tool_use"


def sdk_client(handler) -> anthropic.Anthropic:
    http = httpx.Client(transport=httpx.MockTransport(handler))
    return anthropic.Anthropic(api_key="k", base_url="http://proxy.test", http_client=http, max_retries=0)


def sse_response(data: bytes) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data)


def test_sdk_accumulates_the_stream_to_the_non_streaming_message():
    client = sdk_client(lambda request: sse_response(streamed()))
    with client.messages.stream(model="gyre-tiny", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    expected = Message.model_validate(dialect.response_body(EXPECTED, OUTPUT, USAGE, message_id="msg_01"))
    assert final.model_dump() == expected.model_dump()


def test_sdk_reads_the_non_streaming_response():
    body = dialect.response_body(EXPECTED, OUTPUT, USAGE, message_id="msg_01")
    client = sdk_client(lambda request: httpx.Response(200, json=body))
    message = client.messages.create(model="gyre-tiny", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert message.content[3].input == {"command": "ls -la"}


def test_stream_edge_cases():
    writer = dialect.StreamWriter(EXPECTED, message_id="m", input_tokens=5)
    writer.start()
    assert writer.event(TextDelta("")) == b""
    bad_call = ToolCall(id="t", name="Bash", arguments="oops")
    frames = split_sse(
        writer.event(ToolCallDone(bad_call)) + writer.finish(AssistantOutput(), Usage(input_tokens=5, output_tokens=2))
    )
    assert frames[1][1]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert frames[3][1]["delta"]["stop_reason"] == "tool_use"  # a streamed call makes it a tool_use turn
    assert frames[3][1]["usage"]["output_tokens"] == 2


def test_error_after_the_stream_started_reaches_the_sdk():
    writer = dialect.StreamWriter(EXPECTED, message_id="m", input_tokens=5)
    data = writer.start() + writer.event(TextDelta("part")) + writer.error(ApiError("overloaded", "engine gone"))
    assert writer.error(ApiError("api_error", "again")) == b""  # nothing follows the first error
    client = sdk_client(lambda request: sse_response(data))
    with pytest.raises(anthropic.APIStatusError, match="engine gone"):  # noqa: SIM117
        with client.messages.stream(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}]) as s:
            s.get_final_message()


# ----------------------------------------------------------------------------- errors and models


@pytest.mark.parametrize(
    ("kind", "type_name"),
    [
        ("invalid_request", "invalid_request_error"),
        ("prompt_too_long", "invalid_request_error"),
        ("authentication", "authentication_error"),
        ("permission", "permission_error"),
        ("not_found", "not_found_error"),
        ("request_too_large", "request_too_large"),
        ("rate_limit", "rate_limit_error"),
        ("overloaded", "overloaded_error"),
        ("api_error", "api_error"),
    ],
)
def test_error_body_shapes(kind, type_name):
    body = dialect.error_body(ApiError(kind, "went wrong"))
    assert body == {"type": "error", "error": {"type": type_name, "message": "went wrong"}}
    if type_name != "request_too_large":  # the SDK's union lacks the 413 type the API documents
        assert ErrorResponse.model_validate(body).error.type == type_name


def test_prompt_too_long_reaches_claude_code_as_a_400_with_the_message():
    message = "prompt is too long: 210000 tokens > 200000 maximum"
    error = ApiError("prompt_too_long", message)
    client = sdk_client(lambda request: httpx.Response(error.status, json=dialect.error_body(error)))
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["message"] == message


def test_models_body():
    body = dialect.models_body(["gyre-tiny", "qwen3-8b"])
    assert [ModelInfo.model_validate(m).id for m in body["data"]] == ["gyre-tiny", "qwen3-8b"]
    assert (body["has_more"], body["first_id"], body["last_id"]) == (False, "gyre-tiny", "qwen3-8b")
    assert dialect.models_body([]) == {"data": [], "has_more": False, "first_id": None, "last_id": None}


# ----------------------------------------------------------------------------- fuzz

json_leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
keys = st.sampled_from(["type", "text", "role", "content", "tool_use_id", "input", "id", "name", "thinking"])


def _containers(value, out):
    if isinstance(value, dict | list):
        out.append(value)
        for child in value.values() if isinstance(value, dict) else value:
            _containers(child, out)
    return out


@st.composite
def mutated_bodies(draw):
    body = claude_code_body()
    for _ in range(draw(st.integers(1, 4))):
        container = draw(st.sampled_from(_containers(body, [])))
        if isinstance(container, dict):
            key = draw(keys | st.sampled_from(sorted(container) or ["type"]))
            if container and draw(st.booleans()):
                container.pop(draw(st.sampled_from(sorted(container))))
            else:
                container[key] = copy.deepcopy(draw(json_values))
        elif container and draw(st.booleans()):
            container[draw(st.integers(0, len(container) - 1))] = copy.deepcopy(draw(json_values))
        else:
            container.append(copy.deepcopy(draw(json_values)))
    return body


def _parse_only_api_errors(body):
    for parser in (dialect.parse_request, dialect.parse_count_tokens):
        try:
            request = parser(copy.deepcopy(body), HEADERS, {})
        except ApiError as error:
            assert error.kind == "invalid_request" and error.message
        else:
            assert isinstance(request, ChatRequest)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values | st.dictionaries(st.sampled_from(sorted(claude_code_body())), json_values))
def test_fuzz_arbitrary_bodies_raise_only_api_errors(body):
    _parse_only_api_errors(body)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_bodies())
def test_fuzz_mutated_claude_code_bodies_raise_only_api_errors(body):
    _parse_only_api_errors(body)
