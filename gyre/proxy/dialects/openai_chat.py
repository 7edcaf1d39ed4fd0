"""OpenAI Chat Completions dialect: `POST /v1/chat/completions` and `GET /v1/models` (pure: JSON in, JSON/SSE out).

Contract (the HTTP server calls these; no IO here):
- `parse_request(body, headers, query) -> ChatRequest`: validates the decoded JSON and raises `ApiError` naming the
  offending field (`param="messages[2].content"`) for wrong types or missing fields; unknown fields are ignored.
- `response_body(...)`, `StreamWriter` (SSE `data: <json>\\n\\n` chunks ending with `data: [DONE]`), `error_body(...)`
  and `models_body(...)` produce the API's own shapes, as the `openai` SDK's types parse them.
- `OPENAI_CHAT` is this dialect as the server holds it (`gyre.proxy.dialects.protocol.Dialect`). `check` (the kit of
  `gyre.proxy.dialects.fields` in OpenAI's spelling), the error shape and the readers of content and tool
  arguments serve the Responses dialect too.

Canonical mapping (see `gyre.proxy.conversation`): `messages[0]` with role system/developer is `ChatRequest.system`;
later system/developer messages stay `Turn(role="system")` at their position; text parts of one message are joined
with "\\n\\n"; `reasoning_content` is the assistant turn's thinking; tool-call arguments are kept as the given string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gyre.proxy.conversation import (
    GYRE_SIGNAL_HEADERS,
    ApiError,
    AssistantOutput,
    ChatRequest,
    OutputEvent,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallDone,
    ToolSpec,
    Turn,
    Usage,
)
from gyre.proxy.dialects.fields import FieldChecks, Spelling, header_signals, json_type
from gyre.proxy.dialects.incremental import MessageCache
from gyre.proxy.dialects.protocol import stated_role_signals, unsent_events
from gyre.proxy.dialects.sse import KEEPALIVE_COMMENT, sse_event

# ApiError.kind -> (OpenAI error type, code). OpenAI clients key off `code` (Codex: "context_length_exceeded").
ERROR_TYPES: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "prompt_too_long": ("invalid_request_error", "context_length_exceeded"),
    "authentication": ("authentication_error", "invalid_api_key"),
    "permission": ("permission_error", None),
    "not_found": ("not_found_error", None),
    "request_timeout": ("invalid_request_error", "request_timeout"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit": ("rate_limit_error", "rate_limit_exceeded"),
    "overloaded": ("server_error", "server_is_overloaded"),
    "api_error": ("server_error", "server_error"),
}

# Headers recorded as the call's signals; keys are lower-cased.
SIGNAL_HEADERS = ("user-agent", *GYRE_SIGNAL_HEADERS)

FINISH_REASONS = {"stop": "stop", "tool_calls": "tool_calls", "length": "length", "abort": "stop"}


# ----------------------------------------------------------------------------- field checks

# OpenAI's field messages (both OpenAI dialects): "messages[3].content must be an array, got integer"
# (gyre.proxy.dialects.fields).
check = FieldChecks(
    Spelling(expected="{path} must be {allowed}, got {got}", choices="one of {}", at_least="at least {low}")
)

MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file"}  # refused: text-only models


def request_body(body: Any) -> dict[str, Any]:
    """The decoded body as an object (an OpenAI error names no `param` for the body itself)."""
    if not isinstance(body, dict):
        raise ApiError("invalid_request", f"the request body must be a JSON object, got {json_type(body)}")
    return body


def tool_arguments(value: Any, param: str) -> str:
    """Tool-call arguments: the given JSON text as is, or an object as compact JSON."""
    if isinstance(value, str):
        return check.text(value, param)
    if isinstance(value, dict):
        return check.json_text(value, param)
    raise check.wrong_type(param, "a string of JSON or an object", value)


def tool_parameters(value: Any, param: str) -> dict[str, Any]:
    """A tool's JSON-schema parameters: an object (or absent), renderable as UTF-8 JSON."""
    if value is None:
        return {}
    check.json_text(check.object(value, param), param)
    return value


# ----------------------------------------------------------------------------- request


def content_text(content: Any, param: str, text_types: tuple[str, ...], media: Mapping[str, str]) -> str:
    """Text of a `content` (both OpenAI dialects): a string, or parts joined with "\\n\\n": the `text` of parts typed
    one of `text_types`, the `refusal` of refusal parts; a part typed a key of `media` is refused as that input."""
    if isinstance(content, str):
        return check.text(content, param)
    if not isinstance(content, list):
        raise check.wrong_type(param, "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        kind = check.object(part, part_param).get("type")
        if isinstance(kind, str) and kind in media:
            raise check.unsupported_input(f"{part_param}.type", media[kind])
        key = "refusal" if check.choice(kind, f"{part_param}.type", (*text_types, "refusal")) == "refusal" else "text"
        texts.append(check.string(part.get(key), f"{part_param}.{key}"))
    return "\n\n".join(texts)


def _content_text(content: Any, param: str, *, allow_null: bool) -> str:
    if content is None and allow_null:
        return ""
    return content_text(content, param, ("text",), MEDIA_PARTS)


def _tool_calls(value: Any, param: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    calls = []
    for j, call in enumerate(check.array(value, param)):
        call_param = f"{param}[{j}]"
        check.choice(check.object(call, call_param).get("type", "function"), f"{call_param}.type", ("function",))
        function = check.object(call.get("function"), f"{call_param}.function")
        calls.append(
            ToolCall(
                id=check.string(call.get("id"), f"{call_param}.id", non_empty=True),
                name=check.string(function.get("name"), f"{call_param}.function.name", non_empty=True),
                arguments=tool_arguments(function.get("arguments"), f"{call_param}.function.arguments"),
            )
        )
    return tuple(calls)


def _message(message: Any, i: int) -> Turn | str:
    """One `messages[i]` as a Turn; a system/developer message is returned as its text (the caller places it)."""
    param = f"messages[{i}]"
    message = check.object(message, param)
    role = check.choice(message.get("role"), f"{param}.role", ("system", "developer", "user", "assistant", "tool"))
    content = message.get("content")
    if role in ("system", "developer"):
        return _content_text(content, f"{param}.content", allow_null=False)
    if role == "user":
        return Turn(role="user", text=_content_text(content, f"{param}.content", allow_null=False))
    if role == "assistant":
        return Turn(
            role="assistant",
            text=_content_text(content, f"{param}.content", allow_null=True),
            thinking=check.optional_string(message.get("reasoning_content"), f"{param}.reasoning_content") or "",
            tool_calls=_tool_calls(message.get("tool_calls"), f"{param}.tool_calls"),
        )
    return Turn(
        role="tool",
        text=_content_text(content, f"{param}.content", allow_null=False),
        tool_call_id=check.string(message.get("tool_call_id"), f"{param}.tool_call_id", non_empty=True),
    )


def _tools(value: Any) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    specs = []
    for i, tool in enumerate(check.array(value, "tools")):
        param = f"tools[{i}]"
        if check.object(tool, param).get("type") != "function":
            continue  # custom / hosted tools have no function-call form here
        function = check.object(tool.get("function"), f"{param}.function")
        specs.append(
            ToolSpec(
                name=check.string(function.get("name"), f"{param}.function.name", non_empty=True),
                description=check.optional_string(function.get("description"), f"{param}.function.description") or "",
                parameters=tool_parameters(function.get("parameters"), f"{param}.function.parameters"),
            )
        )
    return tuple(specs)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (check.text(value, "stop"),)
    if not isinstance(value, list):
        raise check.wrong_type("stop", "a string or an array of strings", value)
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise check.expected("stop", "a string or an array of strings", f"{json_type(text)} at index {i}")
    return tuple(check.text(text, "stop") for text in value)


def parse_request(
    body: Any, headers: Mapping[str, str], query: Mapping[str, str], *, cache: MessageCache | None = None
) -> ChatRequest:
    """A Chat Completions request body as a ChatRequest; ApiError (invalid_request) names the bad field.

    `cache` (one per conversation thread) makes parsing incremental: see `gyre.proxy.dialects.incremental`."""
    del query  # no query parameters in this API
    body = request_body(body)
    model = check.string(body.get("model"), "model", non_empty=True)
    messages = check.array(body.get("messages"), "messages")
    if not messages:
        raise check.invalid("messages", "must be a non-empty array")
    reused = cache.reusable(messages) if cache is not None else 0
    items = cache.parsed[:reused] if cache is not None else []
    items += [_message(messages[i], i) for i in range(reused, len(messages))]
    system: str | None = None
    turns: list[Turn] = []
    for i, parsed in enumerate(items):
        if isinstance(parsed, Turn):
            turns.append(parsed)
        elif i == 0:
            system = parsed
        else:
            turns.append(Turn(role="system", text=parsed))
    n = body.get("n")
    if n is not None and n != 1:
        raise check.invalid("n", f"only n=1 is supported, got {n!r}")
    stream = check.optional_bool(body.get("stream"), "stream") or False
    stream_options = check.optional_object(body.get("stream_options"), "stream_options") or {}
    include_usage = check.optional_bool(stream_options.get("include_usage"), "stream_options.include_usage")
    max_tokens = check.optional_int(body.get("max_completion_tokens"), "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = check.optional_int(body.get("max_tokens"), "max_tokens", low=1)
    effort = check.optional_string(body.get("reasoning_effort"), "reasoning_effort")
    top_k = check.optional_int(body.get("top_k"), "top_k", low=0)  # not OpenAI's; vLLM/SGLang clients send it
    request = ChatRequest(
        dialect="openai_chat",
        model=model,
        system=system,
        turns=tuple(turns),
        tools=_tools(body.get("tools")) if cache is None else cache.parse_tools(body.get("tools"), _tools),
        stream=stream,
        max_tokens=max_tokens,
        temperature=check.optional_number(body.get("temperature"), "temperature", low=0.0, high=2.0),
        top_p=check.optional_number(body.get("top_p"), "top_p", low=0.0, high=1.0),
        top_k=top_k,
        stop=_stop(body.get("stop")),
        include_usage=include_usage or False,
        thinking=effort is not None and effort != "none",
        signals=header_signals(headers, SIGNAL_HEADERS),
    )
    if cache is not None:
        cache.store(messages, items)
    return request


# ----------------------------------------------------------------------------- responses


def error_body(error: ApiError) -> dict[str, Any]:
    """The OpenAI error shape `{"error": {message, type, param, code}}` (shared by Chat Completions and Responses)."""
    kind, code = ERROR_TYPES[error.kind]
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def response_body(
    request: ChatRequest, output: AssistantOutput, usage: Usage, *, response_id: str, created: int
) -> dict[str, Any]:
    """The non-streaming `chat.completion` object."""
    message: dict[str, Any] = {"role": "assistant", "content": output.text or None, "refusal": None}
    if output.thinking:
        message["reasoning_content"] = output.thinking
    if output.tool_calls:
        message["tool_calls"] = [_tool_call_json(call) for call in output.tool_calls]
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": request.model,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": FINISH_REASONS[output.stop_reason]}
        ],
        "usage": _usage(usage),
    }


def models_body(names: Sequence[str], created: int) -> dict[str, Any]:
    """`GET /v1/models`: the served model names in OpenAI's list shape."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "gyre"} for name in names],
    }


class StreamWriter:
    """SSE `chat.completion.chunk`s for one streamed call: start, one chunk per event, finish (or error).

    `finish` first sends whatever of `output` the events did not carry (a text/thinking suffix, tool calls not yet
    sent), so the accumulated stream always equals `response_body` for the same output.
    """

    def __init__(self, request: ChatRequest, *, response_id: str, created: int, input_tokens: int):
        self.request = request
        self.response_id = response_id
        self.created = created
        self._text = ""
        self._thinking = ""
        self._num_tool_calls = 0

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return sse_event(
            {
                "id": self.response_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.request.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            }
        )

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def event(self, ev: OutputEvent) -> bytes:
        if isinstance(ev, TextDelta):
            if not ev.text:
                return b""
            self._text += ev.text
            return self._chunk({"content": ev.text})
        if isinstance(ev, ThinkingDelta):
            if not ev.text:
                return b""
            self._thinking += ev.text
            return self._chunk({"reasoning_content": ev.text})
        assert isinstance(ev, ToolCallDone), ev
        index = self._num_tool_calls
        self._num_tool_calls += 1
        return self._chunk({"tool_calls": [{"index": index, **_tool_call_json(ev.call)}]})

    def finish(self, output: AssistantOutput, usage: Usage) -> bytes:
        unsent = unsent_events(output, thinking=self._thinking, text=self._text, num_tool_calls=self._num_tool_calls)
        out = b"".join(self.event(event) for event in unsent)
        out += self._chunk({}, FINISH_REASONS[output.stop_reason])
        if self.request.include_usage:
            out += sse_event(
                {
                    "id": self.response_id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.request.model,
                    "choices": [],
                    "usage": _usage(usage),
                }
            )
        return out + b"data: [DONE]\n\n"

    def error(self, error: ApiError) -> bytes:
        """An error after the stream started: OpenAI sends the error object as a data record."""
        return sse_event(error_body(error)) + b"data: [DONE]\n\n"


# ----------------------------------------------------------------------------- the dialect


class OpenAIChat:
    """The OpenAI Chat Completions API as the server holds it (`gyre.proxy.dialects.protocol.Dialect`)."""

    name = "openai_chat"
    path = "/v1/chat/completions"
    count_tokens_path = None
    response_prefix = "chatcmpl-"
    call_prefix = "call_"
    incremental = True
    history_field = "messages"

    parse_request = staticmethod(parse_request)
    response_body = staticmethod(response_body)
    stream_writer = StreamWriter
    # Shared with the Responses dialect (it derives from this class): OpenAI's error shape and model listing.
    error_body = staticmethod(error_body)
    models_body = staticmethod(models_body)
    role_signals = staticmethod(stated_role_signals)

    def lists_models_for(self, headers: Mapping[str, str]) -> bool:
        return True  # OpenAI SDKs send no marker: every listing the Anthropic dialect does not claim is OpenAI's


OPENAI_CHAT = OpenAIChat()
