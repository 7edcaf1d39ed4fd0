"""OpenAI Chat Completions dialect: `POST /v1/chat/completions` and `GET /v1/models` (pure: JSON in, JSON/SSE out).

Contract (the HTTP server calls these; no IO here):
- `parse_request(body, headers, query) -> ChatRequest`: validates the decoded JSON and raises `ApiError` naming the
  offending field (`param="messages[2].content"`) for wrong types or missing fields; unknown fields are ignored.
- `response_body(...)`, `StreamWriter` (SSE `data: <json>\\n\\n` chunks ending with `data: [DONE]`), `error_body(...)`
  and `models_body(...)` produce the API's own shapes, as the `openai` SDK's types parse them.

Canonical mapping (see `gyre.proxy.conversation`): `messages[0]` with role system/developer is `ChatRequest.system`;
later system/developer messages stay `Turn(role="system")` at their position; text parts of one message are joined
with "\\n\\n"; `reasoning_content` is the assistant turn's thinking; tool-call arguments are kept as the given string.
"""

from __future__ import annotations

import math
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
    compact_json,
)
from gyre.proxy.dialects.incremental import MessageCache
from gyre.proxy.dialects.sse import sse_event

# ApiError.kind -> (OpenAI error type, code). OpenAI clients key off `code` (Codex: "context_length_exceeded").
ERROR_TYPES: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "prompt_too_long": ("invalid_request_error", "context_length_exceeded"),
    "authentication": ("authentication_error", "invalid_api_key"),
    "permission": ("permission_error", None),
    "not_found": ("not_found_error", None),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit": ("rate_limit_error", "rate_limit_exceeded"),
    "overloaded": ("server_error", "server_is_overloaded"),
    "api_error": ("server_error", "server_error"),
}

FINISH_REASONS = {"stop": "stop", "tool_calls": "tool_calls", "length": "length", "abort": "stop"}


# ----------------------------------------------------------------------------- field readers


def invalid(message: str, param: str | None) -> ApiError:
    return ApiError("invalid_request", message, param=param)


def json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, int | float) else type(value).__name__
    )


def checked_text(value: str, param: str) -> str:
    """`value` if it can be encoded as UTF-8 (a JSON `\\ud800` escape decodes to a lone surrogate that cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{param} contains invalid Unicode (a lone surrogate)", param) from None
    return value


def require_str(obj: Mapping[str, Any], key: str, param: str, *, allow_empty: bool = True) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise invalid(f"{param} must be a string, got {json_type(value)}", param)
    if not allow_empty and not value:
        raise invalid(f"{param} must be a non-empty string", param)
    return checked_text(value, param)


def optional_str(obj: Mapping[str, Any], key: str, param: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(f"{param} must be a string, got {json_type(value)}", param)
    return checked_text(value, param)


def optional_bool(obj: Mapping[str, Any], key: str, param: str) -> bool | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"{param} must be a boolean, got {json_type(value)}", param)
    return value


def optional_number(obj: Mapping[str, Any], key: str, param: str, *, low: float, high: float) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"{param} must be a number, got {json_type(value)}", param)
    if not low <= value <= high:
        raise invalid(f"{param} must be between {low} and {high}, got {value}", param)
    return float(value)


def optional_positive_int(obj: Mapping[str, Any], key: str, param: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{param} must be an integer, got {json_type(value)}", param)
    if value < 1:
        raise invalid(f"{param} must be at least 1, got {value}", param)
    return value


def checked_schema(value: Any, param: str) -> dict[str, Any]:
    """A tool's JSON-schema parameters: an object (or absent), renderable as UTF-8 JSON."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{param} must be an object, got {json_type(value)}", param)
    try:
        compact_json(value).encode("utf-8")
    except (UnicodeEncodeError, RecursionError, ValueError):
        raise invalid(f"{param} is not a valid JSON schema object", param) from None
    return value


def tool_arguments(value: Any, param: str) -> str:
    """Tool-call arguments: the given JSON text as is, or an object as compact JSON."""
    if isinstance(value, str):
        return checked_text(value, param)
    if isinstance(value, dict):
        return checked_text(compact_json(value), param)
    raise invalid(f"{param} must be a string of JSON, got {json_type(value)}", param)


def lower_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {str(k).lower(): v for k, v in headers.items()}


# ----------------------------------------------------------------------------- request


def _content_text(content: Any, param: str, *, allow_null: bool) -> str:
    """Text of a message `content`: a string, or a list of text parts joined with "\\n\\n"."""
    if content is None and allow_null:
        return ""
    if isinstance(content, str):
        return checked_text(content, param)
    if not isinstance(content, list):
        raise invalid(f"{param} must be a string or an array of content parts, got {json_type(content)}", param)
    texts = []
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid(f"{part_param} must be an object, got {json_type(part)}", part_param)
        kind = part.get("type")
        if kind == "text":
            texts.append(require_str(part, "text", f"{part_param}.text"))
        elif kind == "refusal":
            texts.append(require_str(part, "refusal", f"{part_param}.refusal"))
        elif kind in ("image_url", "input_audio", "file"):
            what = {"image_url": "image", "input_audio": "audio", "file": "file"}[kind]
            raise invalid(f"{what} input is not supported", f"{part_param}.type")
        else:
            raise invalid(f"{part_param}.type must be 'text', got {kind!r}", f"{part_param}.type")
    return "\n\n".join(texts)


def _tool_calls(value: Any, param: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(f"{param} must be an array, got {json_type(value)}", param)
    calls = []
    for j, call in enumerate(value):
        call_param = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise invalid(f"{call_param} must be an object, got {json_type(call)}", call_param)
        if call.get("type", "function") != "function":
            raise invalid(f"{call_param}.type must be 'function', got {call.get('type')!r}", f"{call_param}.type")
        function = call.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{call_param}.function must be an object", f"{call_param}.function")
        calls.append(
            ToolCall(
                id=require_str(call, "id", f"{call_param}.id", allow_empty=False),
                name=require_str(function, "name", f"{call_param}.function.name", allow_empty=False),
                arguments=tool_arguments(function.get("arguments"), f"{call_param}.function.arguments"),
            )
        )
    return tuple(calls)


def _message(message: Any, i: int) -> Turn | str:
    """One `messages[i]` as a Turn; a system/developer message is returned as its text (the caller places it)."""
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise invalid(f"{param} must be an object, got {json_type(message)}", param)
    role = message.get("role")
    content = message.get("content")
    if role in ("system", "developer"):
        return _content_text(content, f"{param}.content", allow_null=False)
    if role == "user":
        return Turn(role="user", text=_content_text(content, f"{param}.content", allow_null=False))
    if role == "assistant":
        return Turn(
            role="assistant",
            text=_content_text(content, f"{param}.content", allow_null=True),
            thinking=optional_str(message, "reasoning_content", f"{param}.reasoning_content") or "",
            tool_calls=_tool_calls(message.get("tool_calls"), f"{param}.tool_calls"),
        )
    if role == "tool":
        return Turn(
            role="tool",
            text=_content_text(content, f"{param}.content", allow_null=False),
            tool_call_id=require_str(message, "tool_call_id", f"{param}.tool_call_id", allow_empty=False),
        )
    raise invalid(
        f"{param}.role must be one of 'system', 'developer', 'user', 'assistant', 'tool'; got {role!r}",
        f"{param}.role",
    )


def _tools(value: Any) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(f"tools must be an array, got {json_type(value)}", "tools")
    specs = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"{param} must be an object, got {json_type(tool)}", param)
        if tool.get("type") != "function":
            continue  # custom / hosted tools have no function-call form here
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{param}.function must be an object", f"{param}.function")
        specs.append(
            ToolSpec(
                name=require_str(function, "name", f"{param}.function.name", allow_empty=False),
                description=optional_str(function, "description", f"{param}.function.description") or "",
                parameters=checked_schema(function.get("parameters"), f"{param}.function.parameters"),
            )
        )
    return tuple(specs)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (checked_text(value, "stop"),)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(checked_text(s, "stop") for s in value)
    raise invalid("stop must be a string or an array of strings", "stop")


def parse_request(
    body: Any, headers: Mapping[str, str], query: Mapping[str, str], *, cache: MessageCache | None = None
) -> ChatRequest:
    """A Chat Completions request body as a ChatRequest; ApiError (invalid_request) names the bad field.

    `cache` (one per conversation thread) makes parsing incremental: see `gyre.proxy.dialects.incremental`."""
    del query  # no query parameters in this API
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {json_type(body)}", None)
    model = require_str(body, "model", "model", allow_empty=False)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty array", "messages")
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
        raise invalid("only n=1 is supported", "n")
    stream = optional_bool(body, "stream", "stream") or False
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise invalid(f"stream_options must be an object, got {json_type(stream_options)}", "stream_options")
    include_usage = optional_bool(stream_options or {}, "include_usage", "stream_options.include_usage") or False
    max_tokens = optional_positive_int(body, "max_completion_tokens", "max_completion_tokens")
    if max_tokens is None:
        max_tokens = optional_positive_int(body, "max_tokens", "max_tokens")
    effort = optional_str(body, "reasoning_effort", "reasoning_effort")
    top_k = body.get("top_k")  # not OpenAI's; vLLM/SGLang clients send it
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise invalid(f"top_k must be an integer, got {json_type(top_k)}", "top_k")
    hdrs = lower_headers(headers)
    request = ChatRequest(
        dialect="openai_chat",
        model=model,
        system=system,
        turns=tuple(turns),
        tools=_tools(body.get("tools")) if cache is None else cache.parse_tools(body.get("tools"), _tools),
        stream=stream,
        max_tokens=max_tokens,
        temperature=optional_number(body, "temperature", "temperature", low=0.0, high=2.0),
        top_p=optional_number(body, "top_p", "top_p", low=0.0, high=1.0),
        top_k=top_k,
        stop=_stop(body.get("stop")),
        include_usage=include_usage,
        thinking=effort is not None and effort != "none",
        signals={k: hdrs[k] for k in ("user-agent", *GYRE_SIGNAL_HEADERS) if k in hdrs},
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
        out = b""
        if output.thinking.startswith(self._thinking):
            out += self.event(ThinkingDelta(output.thinking[len(self._thinking) :]))
        if output.text.startswith(self._text):
            out += self.event(TextDelta(output.text[len(self._text) :]))
        for call in output.tool_calls[self._num_tool_calls :]:
            out += self.event(ToolCallDone(call))
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
