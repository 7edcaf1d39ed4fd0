"""OpenAI Chat Completions dialect: request parsing, bodies and SSE checked against the real `openai` SDK types."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_strategies import DELETE, JSON, all_paths, mutate
from openai.types.chat import ChatCompletion, ChatCompletionChunk

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
from gyre.proxy.dialects import openai_chat as chat

READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def tool_round_trip_body() -> dict:
    return {
        "model": "qwen3-0.6b",
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Read README.md"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I should read the file.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read", "arguments": '{"path": "README.md"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "# gyre"}]},
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Ok?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It says gyre."}]},
            {"role": "user", "content": [{"type": "text", "text": "thanks"}], "name": "me"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": READ_SCHEMA}},
            {"type": "function", "function": {"name": "noop"}},
        ],
        "max_completion_tokens": 256,
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.95,
        "stop": "</done>",
        "stream": True,
        "stream_options": {"include_usage": True},
        "reasoning_effort": "low",
        "seed": 3,
        "some_future_field": {"x": 1},
    }


def test_tool_round_trip_request_parses_to_exact_chat_request():
    request = chat.parse_request(tool_round_trip_body(), {"User-Agent": "OpenAI/Python 3.57.0"}, {})
    assert request == ChatRequest(
        dialect="openai_chat",
        model="qwen3-0.6b",
        system="You are a coding agent.",
        turns=(
            Turn(role="user", text="Read README.md"),
            Turn(
                role="assistant",
                thinking="I should read the file.",
                tool_calls=(ToolCall(id="call_1", name="read", arguments='{"path": "README.md"}'),),
            ),
            Turn(role="tool", text="# gyre", tool_call_id="call_1"),
            Turn(role="system", text="Be brief.\n\nOk?"),
            Turn(role="assistant", text="It says gyre."),
            Turn(role="user", text="thanks"),
        ),
        tools=(
            ToolSpec(name="read", description="Read a file", parameters=READ_SCHEMA),
            ToolSpec(name="noop"),
        ),
        stream=True,
        max_tokens=256,
        temperature=0.7,
        top_p=0.95,
        stop=("</done>",),
        include_usage=True,
        thinking=True,
        signals={"user-agent": "OpenAI/Python 3.57.0"},
    )


def test_defaults_of_a_minimal_request():
    request = chat.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, {}, {})
    assert request.system is None
    assert request.turns == (Turn(role="user", text="hi"),)
    assert (request.stream, request.include_usage, request.thinking, request.max_tokens) == (False, False, False, None)
    assert chat.parse_request({**tool_round_trip_body(), "reasoning_effort": "none"}, {}, {}).thinking is False


def test_object_arguments_become_compact_json_and_stop_lists_are_kept():
    body = tool_round_trip_body()
    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = {"path": "README.md", "n": 1}
    body["stop"] = ["a", "b"]
    request = chat.parse_request(body, {}, {})
    assert request.turns[1].tool_calls[0].arguments == '{"path":"README.md","n":1}'
    assert request.stop == ("a", "b")


@pytest.mark.parametrize(
    "path, value, param, message",
    [
        (["model"], DELETE, "model", "model must be a string"),
        (["messages"], [], "messages", "non-empty"),
        (["messages", 1], "hi", "messages[1]", "must be an object"),
        (["messages", 1, "role"], "function", "messages[1].role", "must be one of"),
        (["messages", 1, "content"], 5, "messages[1].content", "string or an array"),
        (["messages", 1, "content"], None, "messages[1].content", "string or an array"),
        (
            ["messages", 1, "content"],
            [{"type": "image_url", "image_url": {"url": "data:"}}],
            "messages[1].content[0].type",
            "image input is not supported",
        ),
        (["messages", 2, "tool_calls", 0, "id"], DELETE, "messages[2].tool_calls[0].id", "must be a string"),
        (
            ["messages", 2, "tool_calls", 0, "function", "arguments"],
            3,
            "messages[2].tool_calls[0].function.arguments",
            "JSON",
        ),
        (["messages", 2, "tool_calls"], {}, "messages[2].tool_calls", "must be an array"),
        (["messages", 2, "reasoning_content"], 1, "messages[2].reasoning_content", "must be a string"),
        (["messages", 3, "tool_call_id"], DELETE, "messages[3].tool_call_id", "must be a string"),
        (["messages", 4, "content", 1, "text"], None, "messages[4].content[1].text", "must be a string"),
        (["tools", 0, "function", "parameters"], "x", "tools[0].function.parameters", "must be an object"),
        (["tools", 1, "function"], DELETE, "tools[1].function", "must be an object"),
        (["max_completion_tokens"], 0, "max_completion_tokens", "at least 1"),
        (["max_tokens"], True, "max_tokens", "integer"),
        (["temperature"], "hot", "temperature", "number"),
        (["temperature"], 7, "temperature", "between"),
        (["top_k"], -5, "top_k", "at least 0"),  # as Anthropic's dialect: 0 = off, below it is nonsense
        (["stop"], [1], "stop", "strings"),
        (["stream"], "yes", "stream", "boolean"),
        (["stream_options"], [], "stream_options", "object"),
        (["n"], 2, "n", "n=1"),
        (["messages", 1, "content"], "bad \ud800 text", "messages[1].content", "lone surrogate"),
    ],
)
def test_bad_fields_raise_api_error_naming_the_field(path, value, param, message):
    body = tool_round_trip_body()
    if path == ["max_tokens"]:
        del body["max_completion_tokens"]
    with pytest.raises(ApiError) as info:
        chat.parse_request(mutate(body, path, value), {}, {})
    assert info.value.kind == "invalid_request"
    assert info.value.param == param
    assert message in info.value.message


def test_non_object_body_is_an_api_error():
    with pytest.raises(ApiError, match="JSON object"):
        chat.parse_request([1, 2], {}, {})


def test_error_body_shapes():
    too_long = chat.error_body(ApiError("prompt_too_long", "prompt is too long: 9000 tokens > 8192"))
    assert too_long == {
        "error": {
            "message": "prompt is too long: 9000 tokens > 8192",
            "type": "invalid_request_error",
            "param": None,
            "code": "context_length_exceeded",
        }
    }
    bad = chat.error_body(
        ApiError("invalid_request", "messages[1].content must be a string", param="messages[1].content")
    )
    assert bad["error"]["param"] == "messages[1].content" and bad["error"]["type"] == "invalid_request_error"
    assert chat.error_body(ApiError("authentication", "no key"))["error"]["type"] == "authentication_error"
    assert chat.error_body(ApiError("api_error", "boom"))["error"]["type"] == "server_error"


def test_models_body():
    assert chat.models_body(["a", "b"], 7) == {
        "object": "list",
        "data": [
            {"id": "a", "object": "model", "created": 7, "owned_by": "gyre"},
            {"id": "b", "object": "model", "created": 7, "owned_by": "gyre"},
        ],
    }


# ----------------------------------------------------------------------------- responses and streams

CALLS = (
    ToolCall(id="call_a", name="read", arguments='{"path": "a.py"}'),
    ToolCall(id="call_b", name="noop", arguments="{}"),
)
OUTPUTS = [
    AssistantOutput(text="Hello there.", stop_reason="stop"),
    AssistantOutput(text="Let me look.", thinking="Need to read a.py.", tool_calls=CALLS, stop_reason="tool_calls"),
    AssistantOutput(tool_calls=CALLS[:1], stop_reason="tool_calls"),
    AssistantOutput(text="truncated", stop_reason="length"),
    AssistantOutput(text="", stop_reason="abort"),
]
USAGE = Usage(input_tokens=120, output_tokens=30, cached_tokens=100)


def request_for(include_usage: bool = True) -> ChatRequest:
    return chat.parse_request({**tool_round_trip_body(), "stream_options": {"include_usage": include_usage}}, {}, {})


@pytest.mark.parametrize("output", OUTPUTS)
def test_response_body_is_a_valid_chat_completion(output):
    body = chat.response_body(request_for(), output, USAGE, response_id="chatcmpl-1", created=1700000000)
    completion = ChatCompletion.model_validate(body)
    choice = completion.choices[0]
    assert choice.message.content == (output.text or None)
    assert (
        choice.finish_reason
        == {"stop": "stop", "tool_calls": "tool_calls", "length": "length", "abort": "stop"}[output.stop_reason]
    )
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [
        (c.id, c.name, c.arguments) for c in output.tool_calls
    ]
    assert ("reasoning_content" in body["choices"][0]["message"]) == bool(output.thinking)
    assert completion.usage.prompt_tokens == 120 and completion.usage.total_tokens == 150
    assert completion.usage.prompt_tokens_details.cached_tokens == 100
    assert completion.model == "qwen3-0.6b" and completion.id == "chatcmpl-1"


def parse_sse(data: bytes) -> tuple[list[dict], bool]:
    """The JSON payloads of `data:` records, and whether the stream ended with [DONE]."""
    assert data.endswith(b"\n\n")
    payloads, done = [], False
    for record in data.decode().split("\n\n")[:-1]:
        assert record.startswith("data: "), record
        assert not done, "nothing may follow [DONE]"
        if record == "data: [DONE]":
            done = True
        else:
            payloads.append(json.loads(record.removeprefix("data: ")))
    return payloads, done


def stream_events(output: AssistantOutput, split: int) -> list:
    """The events a parser would emit for `output`, text split into pieces of `split` characters."""
    events = [ThinkingDelta(output.thinking[i : i + split]) for i in range(0, len(output.thinking), split)]
    events += [TextDelta(output.text[i : i + split]) for i in range(0, len(output.text), split)]
    return events + [ToolCallDone(call) for call in output.tool_calls]


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("events_sent", ["all", "none", "half"])
def test_stream_accumulates_to_the_non_stream_body(output, include_usage, events_sent):
    request = request_for(include_usage)
    writer = chat.StreamWriter(request, response_id="chatcmpl-1", created=1700000000, input_tokens=120)
    events = stream_events(output, 3)
    events = {"all": events, "none": [], "half": events[: len(events) // 2]}[events_sent]
    data = writer.start() + b"".join(writer.event(ev) for ev in events) + writer.finish(output, USAGE)
    payloads, done = parse_sse(data)
    assert done
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads]
    assert all(c.id == "chatcmpl-1" and c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""

    content, reasoning, calls, finish = "", "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                calls[call.index] = call
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    body = chat.response_body(request, output, USAGE, response_id="chatcmpl-1", created=1700000000)
    message = body["choices"][0]["message"]
    assert (content or None) == message["content"]
    assert reasoning == message.get("reasoning_content", "")
    assert [
        {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for _, c in sorted(calls.items())
    ] == message.get("tool_calls", [])
    assert finish == [body["choices"][0]["finish_reason"]]
    assert not chunks[-2 if include_usage else -1].choices[0].delta.content  # the finish chunk has an empty delta
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude_none=True) == body["usage"]
    else:
        assert all(c.usage is None for c in chunks)


def test_stream_error_is_an_error_record_then_done():
    writer = chat.StreamWriter(request_for(), response_id="chatcmpl-1", created=1, input_tokens=3)
    payloads, done = parse_sse(writer.error(ApiError("overloaded", "engine overloaded")))
    assert done and payloads == [chat.error_body(ApiError("overloaded", "engine overloaded"))]


# ----------------------------------------------------------------------------- fuzz

BASE_PATHS = all_paths(tool_round_trip_body())[1:]


def parse_or_api_error(body) -> None:
    try:
        request = chat.parse_request(body, {"user-agent": "x"}, {})
    except ApiError as error:
        assert error.status == 400
        json.dumps(chat.error_body(error))
    else:
        assert isinstance(request, ChatRequest)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JSON)
def test_fuzz_any_json_body_only_raises_api_error(body):
    parse_or_api_error(body)
    parse_or_api_error({"model": "m", "messages": body})


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(BASE_PATHS), JSON | st.just(DELETE))
def test_fuzz_mutated_realistic_body_only_raises_api_error(path, value):
    parse_or_api_error(mutate(tool_round_trip_body(), list(path), value))
