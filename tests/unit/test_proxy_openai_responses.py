"""OpenAI Responses dialect (Codex): request parsing, bodies and SSE checked against the real `openai` SDK types."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_strategies import DELETE, JSON, all_paths, mutate
from openai.types.responses import Response, ResponseStreamEvent
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
    compact_json,
)
from gyre.proxy.dialects import openai_responses as responses

EXEC_SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
CUSTOM_SCHEMA = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
BASE_PROMPT = "You are Codex, a coding agent based on GPT-5."
HEADERS = {
    "Authorization": "Bearer sk-test",
    "User-Agent": "codex_exec/0.171.0 (Linux; x86_64)",
    "x-codex-turn-metadata": '{"request_kind":"turn","turn_id":"t-1","sandbox":"workspace-write"}',
    "thread-id": "019a-thread",
    "session_id": "019a-session",
    "OpenAI-Beta": "responses=experimental",
}


def text_message(role: str, text: str, part: str = "input_text") -> dict:
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def codex_body() -> dict:
    """A Codex turn after two tool round trips: our earlier output items are echoed verbatim (ids included)."""
    return {
        "model": "gpt-5-codex",
        "input": [
            text_message("developer", BASE_PROMPT),
            text_message("developer", "<permissions instructions>sandbox: workspace-write</permissions instructions>"),
            text_message("user", "<environment_context><cwd>/repo</cwd></environment_context>"),
            text_message("user", "List the files, then read a.py"),
            {
                "type": "reasoning",
                "id": "rs_abc_0",
                "summary": [{"type": "summary_text", "text": "I will list the files."}],
                "encrypted_content": None,
            },
            {
                "type": "function_call",
                "id": "fc_abc_1",
                "call_id": "call_1",
                "name": "exec_command",
                "arguments": '{"cmd":"ls"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nREADME.md\n"},
            {"type": "reasoning", "id": "rs_def_0", "summary": [{"type": "summary_text", "text": "Now read it."}]},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_def_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Reading a.py.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_def_2",
                "call_id": "call_2",
                "namespace": "mcp__fs",
                "name": "read",
                "arguments": '{"path":"a.py"}',
            },
            {
                "type": "custom_tool_call",
                "id": "ctc_def_3",
                "call_id": "call_3",
                "name": "apply_patch",
                "input": "*** Begin Patch\n*** End Patch",
            },
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "x = 1"}]},
            {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Success."},
            {"role": "user", "content": "thanks, now stop"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Run a command",
                "strict": False,
                "parameters": EXEC_SCHEMA,
            },
            {
                "type": "namespace",
                "name": "mcp__fs",
                "description": "File system MCP server",
                "tools": [
                    {"type": "function", "name": "read", "description": "Read a file", "parameters": READ_SCHEMA}
                ],
            },
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "Apply a patch",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a-thread",
        "text": {"verbosity": "low"},
        "client_metadata": {"x-codex-turn-metadata": '{"request_kind":"turn"}'},
    }


EXPECTED_TOOLS = (
    ToolSpec(name="exec_command", description="Run a command", parameters=EXEC_SCHEMA),
    ToolSpec(name="mcp__fs__read", description="Read a file", parameters=READ_SCHEMA),
    ToolSpec(name="apply_patch", description="Apply a patch", parameters=CUSTOM_SCHEMA),
)


def test_codex_request_parses_to_exact_chat_request():
    request = responses.parse_request(codex_body(), HEADERS, {})
    expected_turns = (
        Turn(role="system", text="<permissions instructions>sandbox: workspace-write</permissions instructions>"),
        Turn(role="user", text="<environment_context><cwd>/repo</cwd></environment_context>"),
        Turn(role="user", text="List the files, then read a.py"),
        Turn(
            role="assistant",
            thinking="I will list the files.",
            tool_calls=(ToolCall(id="call_1", name="exec_command", arguments='{"cmd":"ls"}'),),
        ),
        Turn(role="tool", text="a.py\nREADME.md\n", tool_call_id="call_1"),
        Turn(
            role="assistant",
            text="Reading a.py.",
            thinking="Now read it.",
            tool_calls=(
                ToolCall(id="call_2", name="mcp__fs__read", arguments='{"path":"a.py"}'),
                ToolCall(id="call_3", name="apply_patch", arguments='{"input":"*** Begin Patch\\n*** End Patch"}'),
            ),
        ),
        Turn(role="tool", text="x = 1", tool_call_id="call_2"),
        Turn(role="tool", text="Success.", tool_call_id="call_3"),
        Turn(role="user", text="thanks, now stop"),
    )
    assert request == ChatRequest(
        dialect="openai_responses",
        model="gpt-5-codex",
        system=BASE_PROMPT,
        turns=expected_turns,
        tools=EXPECTED_TOOLS,
        stream=True,
        thinking=True,
        signals={
            "request_kind": "turn",
            "thread-id": "019a-thread",
            "session_id": "019a-session",
            "user-agent": "codex_exec/0.171.0 (Linux; x86_64)",
            "prompt_cache_key": "019a-thread",
        },
        echo=request.echo,
    )
    assert request.echo["custom_tools"] == ["apply_patch"]
    assert request.echo["namespaced_tools"] == {"mcp__fs__read": ["mcp__fs", "read"]}
    assert request.echo["parallel_tool_calls"] is False and request.echo["store"] is False


def test_subagent_signals_and_compaction_request_kind():
    headers = {
        "x-codex-turn-metadata": json.dumps(
            {"request_kind": "compaction", "thread_source": "subagent", "parent_thread_id": "019a-parent"}
        ),
        "thread-id": "019b-child",
    }
    body = {**codex_body(), "tools": []}
    signals = responses.parse_request(body, headers, {}).signals
    assert signals == {
        "request_kind": "compaction",
        "thread_source": "subagent",
        "parent_thread_id": "019a-parent",
        "thread-id": "019b-child",
        "prompt_cache_key": "019a-thread",
    }
    # an invalid header is ignored; the body's client_metadata is the fallback
    signals = responses.parse_request(body, {"x-codex-turn-metadata": "{not json"}, {}).signals
    assert signals == {"request_kind": "turn", "prompt_cache_key": "019a-thread"}


def test_instructions_come_first_in_the_system_prompt_and_string_input_is_one_user_turn():
    request = responses.parse_request({**codex_body(), "instructions": "Be careful."}, {}, {})
    assert request.system == f"Be careful.\n\n{BASE_PROMPT}"
    request = responses.parse_request({"model": "m", "input": "hi", "instructions": "sys"}, {}, {})
    assert (request.system, request.turns, request.thinking) == ("sys", (Turn(role="user", text="hi"),), False)
    request = responses.parse_request(
        {"model": "m", "input": [text_message("user", "a"), text_message("system", "b")]}, {}, {}
    )
    assert request.system is None and request.turns[1] == Turn(role="system", text="b")
    assert responses.parse_request({**codex_body(), "reasoning": {"effort": "none"}}, {}, {}).thinking is False


@pytest.mark.parametrize(
    "path, value, param, message",
    [
        (["model"], 3, "model", "must be a string"),
        (["input"], DELETE, "input", "string or an array"),
        (["input"], [], "input", "at least one"),
        (["input", 3], "hi", "input[3]", "must be an object"),
        (["input", 3, "role"], "tool", "input[3].role", "must be one of"),
        (["input", 3, "content"], None, "input[3].content", "string or an array"),
        (
            ["input", 3, "content", 0],
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            "input[3].content[0].type",
            "image input is not supported",
        ),
        (["input", 3, "content", 0, "type"], "output_audio", "input[3].content[0].type", "must be one of"),
        (["input", 4, "summary"], "x", "input[4].summary", "must be an array"),
        (["input", 4, "summary", 0, "text"], 5, "input[4].summary[0].text", "must be a string"),
        (["input", 5, "call_id"], DELETE, "input[5].call_id", "must be a string"),
        (["input", 5, "arguments"], None, "input[5].arguments", "JSON"),
        (["input", 6, "output"], 12, "input[6].output", "string or an array"),
        (["input", 10, "input"], DELETE, "input[10].input", "must be a string"),
        (["input", 5, "type"], "local_shell_call", "input[5].type", "'local_shell_call' is not supported"),
        (["input", 5, "type"], "item_reference", "input[5].type", "'item_reference' is not supported"),
        (["tools"], {}, "tools", "must be an array"),
        (["tools", 0, "name"], DELETE, "tools[0].name", "must be a string"),
        (["tools", 0, "parameters"], [], "tools[0].parameters", "must be an object"),
        (["tools", 1, "tools"], None, "tools[1].tools", "must be an array"),
        (["tools", 1, "tools", 0, "name"], 1, "tools[1].tools[0].name", "must be a string"),
        (["reasoning"], "high", "reasoning", "must be an object"),
        (["reasoning", "effort"], 1, "reasoning.effort", "must be a string"),
        (["max_output_tokens"], -5, "max_output_tokens", "at least 1"),
        (["top_p"], 2, "top_p", "between"),
        (["parallel_tool_calls"], "no", "parallel_tool_calls", "boolean"),
        (["metadata"], [], "metadata", "object"),
        (["tool_choice"], 1, "tool_choice", "string or an object"),
        (["previous_response_id"], "resp_1", "previous_response_id", "not supported"),
        (["instructions"], {"x": 1}, "instructions", "must be a string"),
        (["input", 13, "content"], "\udc80", "input[13].content", "lone surrogate"),
    ],
)
def test_bad_fields_raise_api_error_naming_the_field(path, value, param, message):
    with pytest.raises(ApiError) as info:
        responses.parse_request(mutate(codex_body(), path, value), {}, {})
    assert info.value.kind == "invalid_request"
    assert info.value.param == param
    assert message in info.value.message


def test_non_object_body_is_an_api_error():
    with pytest.raises(ApiError, match="JSON object"):
        responses.parse_request("hello", {}, {})


# ----------------------------------------------------------------------------- responses

CALLS = (
    ToolCall(id="call_a", name="exec_command", arguments='{"cmd": "cat a.py"}'),
    ToolCall(id="call_b", name="mcp__fs__read", arguments='{"path":"b.py"}'),
    ToolCall(id="call_c", name="apply_patch", arguments=compact_json({"input": "*** Begin Patch\n*** End Patch"})),
)
OUTPUTS = [
    AssistantOutput(text="Hello there.", stop_reason="stop"),
    AssistantOutput(text="Let me look.", thinking="Need both files.", tool_calls=CALLS, stop_reason="tool_calls"),
    AssistantOutput(thinking="Just call.", tool_calls=CALLS[1:2], stop_reason="tool_calls"),
    AssistantOutput(text="truncated", stop_reason="length"),
    AssistantOutput(stop_reason="abort"),
]
USAGE = Usage(input_tokens=2000, output_tokens=40, cached_tokens=1900)
EVENTS = TypeAdapter(ResponseStreamEvent)


def codex_request() -> ChatRequest:
    return responses.parse_request(codex_body(), HEADERS, {})


@pytest.mark.parametrize("output", OUTPUTS)
def test_response_body_is_a_valid_response_and_echoes_back_to_the_same_turn(output):
    request = codex_request()
    body = responses.response_body(request, output, USAGE, response_id="resp_42", created=1700000000)
    response = Response.model_validate(body)
    assert response.id == "resp_42" and response.model == "gpt-5-codex"
    assert response.output_text == output.text
    assert response.status == ("incomplete" if output.stop_reason == "length" else "completed")
    if output.stop_reason == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == 2000 and response.usage.total_tokens == 2040
    assert response.usage.input_tokens_details.cached_tokens == 1900
    assert response.parallel_tool_calls is False and response.tool_choice == "auto"
    # deterministic ids: kind prefix, the response id, the output index
    assert [item.id for item in response.output] == [
        f"{item['id'].split('_')[0]}_42_{i}" for i, item in enumerate(body["output"])
    ]
    kinds = [item.type for item in response.output]
    expected_kinds = ["reasoning"] * bool(output.thinking) + ["message"] * bool(output.text)
    expected_kinds += ["custom_tool_call" if c.name == "apply_patch" else "function_call" for c in output.tool_calls]
    assert kinds == expected_kinds
    for item in response.output:
        if item.type == "function_call" and item.call_id == "call_b":
            assert (item.namespace, item.name) == ("mcp__fs", "read")
        if item.type == "custom_tool_call":
            assert item.input == "*** Begin Patch\n*** End Patch"
    # Codex echoes the output items verbatim in the next request: they read back as the same assistant turn
    if body["output"]:
        follow_up = {
            "model": "m",
            "input": [text_message("user", "go"), *body["output"]],
            "tools": codex_body()["tools"],
        }
        echoed = responses.parse_request(follow_up, {}, {}).turns[-1]
        assert echoed == Turn(
            role="assistant", text=output.text, thinking=output.thinking, tool_calls=output.tool_calls
        )


def test_error_body_is_openai_shaped():
    body = responses.error_body(ApiError("prompt_too_long", "prompt is too long: 300000 tokens > 272000"))
    assert body["error"]["code"] == "context_length_exceeded" and body["error"]["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- streams

CODEX_ACCEPTED = {
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
}
REASONING_AND_CUSTOM = {
    "response.reasoning_summary_part.added",
    "response.reasoning_summary_text.delta",
    "response.reasoning_summary_text.done",
    "response.reasoning_summary_part.done",
    "response.custom_tool_call_input.delta",
    "response.custom_tool_call_input.done",
    "response.incomplete",
}


def parse_sse(data: bytes) -> list[dict]:
    """The JSON payloads of `event:`/`data:` records; each event line must name its payload's type."""
    assert data.endswith(b"\n\n")
    payloads = []
    for record in data.decode().split("\n\n")[:-1]:
        event_line, data_line = record.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {payload['type']}"
        payloads.append(payload)
    return payloads


def stream_events(output: AssistantOutput, split: int) -> list:
    events = [ThinkingDelta(output.thinking[i : i + split]) for i in range(0, len(output.thinking), split)]
    events += [TextDelta(output.text[i : i + split]) for i in range(0, len(output.text), split)]
    return events + [ToolCallDone(call) for call in output.tool_calls]


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("events_sent", ["all", "none", "half"])
def test_stream_events_are_valid_and_accumulate_to_the_non_stream_body(output, events_sent):
    request = codex_request()
    writer = responses.StreamWriter(request, response_id="resp_42", created=1700000000, input_tokens=2000)
    events = stream_events(output, 4)
    events = {"all": events, "none": [], "half": events[: len(events) // 2]}[events_sent]
    data = writer.start() + b"".join(writer.event(ev) for ev in events) + writer.finish(output, USAGE)
    payloads = parse_sse(data)
    parsed = [EVENTS.validate_python(p) for p in payloads]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert {p["type"] for p in payloads} <= CODEX_ACCEPTED | REASONING_AND_CUSTOM
    assert [p["type"] for p in payloads[:2]] == ["response.created", "response.in_progress"]
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []

    body = responses.response_body(request, output, USAGE, response_id="resp_42", created=1700000000)
    final = payloads[-1]
    assert final["type"] == ("response.incomplete" if output.stop_reason == "length" else "response.completed")
    assert final["response"] == body

    # what a client accumulates from the deltas equals the items of the final response
    texts: dict[str, str] = {}
    arguments: dict[str, str] = {}
    added, done = [], []
    for p in payloads:
        if p["type"] in ("response.output_text.delta", "response.reasoning_summary_text.delta"):
            texts[p["item_id"]] = texts.get(p["item_id"], "") + p["delta"]
        elif p["type"] in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
            arguments[p["item_id"]] = arguments.get(p["item_id"], "") + p["delta"]
        elif p["type"] == "response.output_item.added":
            added.append((p["output_index"], p["item"]["id"]))
        elif p["type"] == "response.output_item.done":
            done.append(p["item"])
        if "item_id" in p:
            assert body["output"][p["output_index"]]["id"] == p["item_id"]
    assert done == body["output"]
    assert added == [(i, item["id"]) for i, item in enumerate(body["output"])]
    for item in body["output"]:
        if item["type"] == "reasoning":
            assert texts[item["id"]] == item["summary"][0]["text"] == output.thinking
        elif item["type"] == "message":
            assert texts[item["id"]] == item["content"][0]["text"] == output.text
        elif item["type"] == "function_call":
            assert arguments[item["id"]] == item["arguments"]
        else:
            assert arguments[item["id"]] == item["input"]


def test_stream_error_sends_error_then_response_failed():
    writer = responses.StreamWriter(codex_request(), response_id="resp_42", created=1, input_tokens=5)
    started = parse_sse(writer.start())
    payloads = parse_sse(writer.error(ApiError("api_error", "engine died")))
    assert [p["type"] for p in payloads] == ["error", "response.failed"]
    assert [p["sequence_number"] for p in payloads] == [len(started), len(started) + 1]
    failed = EVENTS.validate_python(payloads[1])
    assert failed.response.status == "failed" and failed.response.error.code == "server_error"
    assert EVENTS.validate_python(payloads[0]).message == "engine died"
    # a context overflow carries the code Codex reads to compact
    payloads = parse_sse(writer.error(ApiError("prompt_too_long", "prompt is too long")))
    assert payloads[0]["code"] == payloads[1]["response"]["error"]["code"] == "context_length_exceeded"


# ----------------------------------------------------------------------------- fuzz

BASE_PATHS = all_paths(codex_body())[1:]


def parse_or_api_error(body, headers=HEADERS) -> None:
    try:
        request = responses.parse_request(body, headers, {})
    except ApiError as error:
        assert error.status == 400
        json.dumps(responses.error_body(error))
    else:
        assert isinstance(request, ChatRequest)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JSON, st.text(max_size=20))
def test_fuzz_any_json_body_only_raises_api_error(body, turn_metadata):
    parse_or_api_error(body)
    parse_or_api_error({"model": "m", "input": body}, {"x-codex-turn-metadata": turn_metadata})
    parse_or_api_error({"model": "m", "input": [body]})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(BASE_PATHS), JSON | st.just(DELETE))
def test_fuzz_mutated_codex_body_only_raises_api_error(path, value):
    parse_or_api_error(mutate(codex_body(), list(path), value))
