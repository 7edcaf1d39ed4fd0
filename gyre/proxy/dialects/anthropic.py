"""Anthropic Messages dialect: request JSON -> `ChatRequest`, `AssistantOutput` -> response JSON or SSE bytes.

Contract (pure: no IO; the HTTP server decodes bodies and writes what these functions return):
- `parse_request` / `parse_count_tokens` take the already-decoded JSON body of `POST /v1/messages` and
  `POST /v1/messages/count_tokens` and either return a `ChatRequest` or raise `ApiError("invalid_request", ...)`
  whose message starts with the offending field's dotted path ("messages.3.content.0.type: ...").
  Nothing else escapes, whatever the body holds (a hypothesis test feeds arbitrary JSON).
- Unknown fields, `cache_control`, `metadata`, `context_management`, `output_config`, beta headers and `?beta=true`
  are accepted and ignored (docs/harness.md: Claude Code sends all of them on every call).
- `response_body` builds the non-streaming Messages response; `StreamWriter` produces the SSE events of the
  streaming one (message_start, content_block_start/delta/stop, message_delta, message_stop), in the order the
  real API sends them, so the SDK's own accumulator rebuilds the same message `response_body` returns.
- Usage follows the API's convention: `input_tokens` counts only the prompt tokens not read from cache, so
  `input_tokens + cache_read_input_tokens` is the whole prompt (Claude Code adds them up to track its context).
- `ANTHROPIC` is this dialect as the server holds it (`gyre.proxy.dialects.protocol.Dialect`); fields are checked
  with the kit of `gyre.proxy.dialects.fields` in Anthropic's spelling (`check`).
"""

from __future__ import annotations

import base64
import hashlib
import json
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
from gyre.proxy.dialects.fields import FieldChecks, Spelling, header_signals
from gyre.proxy.dialects.incremental import MessageCache
from gyre.proxy.dialects.protocol import stated_role_signals
from gyre.proxy.dialects.sse import sse_event

# Headers that tell requests of one harness session apart (main agent, sub-agents); keys are lower-cased.
SIGNAL_HEADERS = ("x-claude-code-session-id", "x-claude-code-agent-id", "user-agent", *GYRE_SIGNAL_HEADERS)

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "abort": "end_turn"}

ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "prompt_too_long": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_timeout": "timeout_error",
    "request_too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "api_error": "api_error",
}

MEDIA_BLOCKS = ("image", "document")  # refused: the supported models are text-only
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")
# When a model's release date is unknown the API reports the epoch (anthropic.types.ModelInfo.created_at).
EPOCH = "1970-01-01T00:00:00Z"
# The text blocks of one message are joined like this (gyre.proxy.conversation, canonical content).
BLOCK_SEPARATOR = "\n\n"


# ----------------------------------------------------------------------------- field checks

# Anthropic's field messages: "messages.3.content: expected an array, got integer" (gyre.proxy.dialects.fields).
check = FieldChecks(Spelling(expected="{path}: expected {allowed}, got {got}", choices="{}", at_least=">= {low}"))


# ----------------------------------------------------------------------------- request parsing


def _join(texts: list[str]) -> str:
    return BLOCK_SEPARATOR.join(text for text in texts if text)


def _block_type(block: Any, path: str) -> tuple[dict[str, Any], str]:
    block = check.object(block, path)
    return block, check.string(block.get("type"), f"{path}.type")


def _text_of(block: dict[str, Any], path: str) -> str:
    return check.string(block.get("text"), f"{path}.text")


def _plain_text(content: Any, path: str) -> str:
    """Text of a `system` field, a system message or a tool result: a string or a list of text blocks."""
    if isinstance(content, str):
        return check.text(content, path)
    texts = []
    for i, block in enumerate(check.array(content, path)):
        block, kind = _block_type(block, f"{path}.{i}")
        if kind == "text":
            texts.append(_text_of(block, f"{path}.{i}"))
        elif kind in MEDIA_BLOCKS:
            raise check.unsupported_input(f"{path}.{i}.type", "image")
        else:
            check.choice(kind, f"{path}.{i}.type", ("text",))
    return _join(texts)


def _tool_turn(block: dict[str, Any], path: str, known_call_ids: set[str]) -> Turn:
    call_id = check.string(block.get("tool_use_id"), f"{path}.tool_use_id", non_empty=True)
    if call_id not in known_call_ids:
        raise check.invalid(
            f"{path}.tool_use_id", f"{call_id!r} matches no tool_use block of an earlier assistant message"
        )
    content = block.get("content")
    text = "" if content is None else _plain_text(content, f"{path}.content")
    is_error = check.optional_bool(block.get("is_error"), f"{path}.is_error")
    return Turn(role="tool", tool_call_id=call_id, text=text, is_error=bool(is_error))


def _user_turns(content: Any, path: str, known_call_ids: set[str]) -> list[Turn]:
    """A user message split into consecutive runs: each tool_result a tool turn, each run of text one user turn."""
    if isinstance(content, str):
        return [Turn(role="user", text=check.text(content, path))]
    turns: list[Turn] = []
    texts: list[str] | None = None  # the text run being collected
    for i, block in enumerate(check.array(content, path)):
        block_path = f"{path}.{i}"
        block, kind = _block_type(block, block_path)
        if kind == "text":
            texts = [] if texts is None else texts
            texts.append(_text_of(block, block_path))
        elif kind == "tool_result":
            if texts is not None:
                turns.append(Turn(role="user", text=_join(texts)))
                texts = None
            turns.append(_tool_turn(block, block_path, known_call_ids))
        elif kind in MEDIA_BLOCKS:
            raise check.unsupported_input(f"{block_path}.type", "image")
        else:
            check.choice(kind, f"{block_path}.type", ("text", "tool_result"), where="in a user message")
    if texts is not None or not turns:
        turns.append(Turn(role="user", text=_join(texts or [])))
    return turns


def _assistant_turn(content: Any, path: str, known_call_ids: set[str]) -> Turn:
    if isinstance(content, str):
        return Turn(role="assistant", text=check.text(content, path))
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for i, block in enumerate(check.array(content, path)):
        block_path = f"{path}.{i}"
        block, kind = _block_type(block, block_path)
        if kind == "text":
            texts.append(_text_of(block, block_path))
        elif kind == "thinking":
            thoughts.append(check.string(block.get("thinking"), f"{block_path}.thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque; never produced by us, carries nothing the template could render
        elif kind == "tool_use":
            call_id = check.string(block.get("id"), f"{block_path}.id", non_empty=True)
            name = check.string(block.get("name"), f"{block_path}.name", non_empty=True)
            arguments = check.json_text(check.object(block.get("input"), f"{block_path}.input"), f"{block_path}.input")
            calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
            known_call_ids.add(call_id)
        else:
            check.choice(kind, f"{block_path}.type", ASSISTANT_BLOCKS, where="in an assistant message")
    return Turn(role="assistant", text=_join(texts), thinking=_join(thoughts), tool_calls=tuple(calls))


def _turns(messages: Any, cache: MessageCache | None = None) -> list[Turn]:
    """The turns of `messages`; with a `cache`, the unchanged prefix of the thread's previous request is reused."""
    messages = check.array(messages, "messages")
    if not messages:
        raise check.invalid("messages", "at least one message is required")
    reused = cache.reusable(messages) if cache is not None else 0
    parsed: list[tuple[tuple[Turn, ...], tuple[str, ...]]] = cache.parsed[:reused] if cache is not None else []
    known_call_ids: set[str] = {call_id for _, ids in parsed for call_id in ids}  # a tool_result must answer one
    for i in range(reused, len(messages)):
        parsed.append(_message_turns(messages[i], f"messages.{i}", known_call_ids))
    if cache is not None:
        cache.store(messages, parsed)
    return [turn for turns, _ in parsed for turn in turns]


def _message_turns(message: Any, path: str, known_call_ids: set[str]) -> tuple[tuple[Turn, ...], tuple[str, ...]]:
    """One message's turns and the tool_use ids it adds to `known_call_ids` (which it updates)."""
    message = check.object(message, path)
    content = message.get("content")
    if content is None:
        raise check.invalid(f"{path}.content", "field required")
    role = check.choice(message.get("role"), f"{path}.role", ("user", "assistant", "system"))
    if role == "user":
        return tuple(_user_turns(content, f"{path}.content", known_call_ids)), ()
    if role == "assistant":
        turn = _assistant_turn(content, f"{path}.content", known_call_ids)
        return (turn,), tuple(call.id for call in turn.tool_calls)
    # a system message: Claude Code sends reminders as system messages mid-conversation
    return (Turn(role="system", text=_plain_text(content, f"{path}.content")),), ()


def _tools(tools: Any) -> list[ToolSpec]:
    if tools is None:
        return []
    specs = []
    for i, tool in enumerate(check.array(tools, "tools")):
        path = f"tools.{i}"
        tool = check.object(tool, path)
        kind = tool.get("type")
        if kind is not None and check.string(kind, f"{path}.type") != "custom":
            continue  # a server tool (web_search_..., bash_..., text_editor_...): the API runs it, not the model
        name = check.string(tool.get("name"), f"{path}.name", non_empty=True)
        description = check.optional_string(tool.get("description"), f"{path}.description") or ""
        schema = check.object(tool.get("input_schema"), f"{path}.input_schema")
        check.json_text(schema, f"{path}.input_schema")
        specs.append(ToolSpec(name=name, description=description, parameters=schema))
    return specs


def _thinking(value: Any) -> bool:
    if value is None:
        return False
    kind = check.string(check.object(value, "thinking").get("type"), "thinking.type")
    return check.choice(kind, "thinking.type", ("enabled", "adaptive", "disabled")) != "disabled"


def _parse(
    body: Any, headers: Mapping[str, str], *, require_max_tokens: bool, cache: MessageCache | None = None
) -> ChatRequest:
    body = check.object(body, "body")
    model = check.string(body.get("model"), "model", non_empty=True)
    if require_max_tokens and body.get("max_tokens") is None:
        raise check.invalid("max_tokens", "field required")
    system = body.get("system")
    system_text = None if system is None else (_plain_text(system, "system") or None)
    stop = body.get("stop_sequences")
    stop = [] if stop is None else check.array(stop, "stop_sequences")
    stop_sequences = [check.string(text, f"stop_sequences.{i}") for i, text in enumerate(stop)]
    metadata = body.get("metadata")
    return ChatRequest(
        dialect="anthropic",
        model=model,
        system=system_text,
        turns=_turns(body.get("messages"), cache),
        tools=_tools(body.get("tools")) if cache is None else cache.parse_tools(body.get("tools"), _tools),
        stream=check.optional_bool(body.get("stream"), "stream") or False,
        max_tokens=check.optional_int(body.get("max_tokens"), "max_tokens", low=1),
        temperature=check.optional_number(body.get("temperature"), "temperature", low=0.0, high=2.0),
        top_p=check.optional_number(body.get("top_p"), "top_p", low=0.0, high=1.0),
        top_k=check.optional_int(body.get("top_k"), "top_k", low=0),
        stop=stop_sequences,
        thinking=_thinking(body.get("thinking")),
        signals=header_signals(headers, SIGNAL_HEADERS),
        echo={"metadata": metadata} if isinstance(metadata, dict) else {},
    )


def parse_request(
    body: Any, headers: Mapping[str, str], query: Mapping[str, str], *, cache: MessageCache | None = None
) -> ChatRequest:
    """`POST /v1/messages` (any `?beta=...` query accepted): the body as a `ChatRequest`, or `ApiError`.

    `cache` (one per conversation thread) makes parsing incremental: see `gyre.proxy.dialects.incremental`."""
    del query  # `?beta=true` changes nothing here
    return _parse(body, headers, require_max_tokens=True, cache=cache)


def parse_count_tokens(body: Any, headers: Mapping[str, str], query: Mapping[str, str]) -> ChatRequest:
    """`POST /v1/messages/count_tokens`: like `parse_request`, but `max_tokens` is not required."""
    del query
    return _parse(body, headers, require_max_tokens=False)


def role_signals(request: ChatRequest) -> dict[str, Any]:
    """The recorded role signals: those of every dialect (`stated_role_signals`: the stated role, `summary_request`)
    and `agent_id` from header `x-claude-code-agent-id` (a Claude Code sub-agent)."""
    signals = stated_role_signals(request)
    agent_id = signals.get("x-claude-code-agent-id")
    if agent_id:
        signals["agent_id"] = agent_id
    return signals


# ----------------------------------------------------------------------------- responses


def count_tokens_body(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens}


def error_body(error: ApiError) -> dict[str, Any]:
    """The API's error shape; the HTTP status is `error.status`."""
    return {"type": "error", "error": {"type": ERROR_TYPES[error.kind], "message": error.message}}


def thinking_signature(thinking: str) -> str:
    """An opaque, deterministic token for a thinking block (harnesses echo it back; nothing verifies it)."""
    return base64.b64encode(hashlib.sha256(thinking.encode("utf-8")).digest()).decode("ascii")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _tool_input(arguments: str) -> dict[str, Any] | None:
    """The tool call's arguments as an object; None if the output parser let through anything else."""
    try:
        value = json.loads(arguments, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _stop_reason(output: AssistantOutput, called_tools: bool) -> str:
    if called_tools and output.stop_reason == "stop":
        return "tool_use"  # the client runs tools only when told so; trust the calls over the label
    return STOP_REASONS[output.stop_reason]


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": max(usage.input_tokens - usage.cached_tokens, 0),
        "output_tokens": usage.output_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": _tool_input(call.arguments) or {}}


def response_body(request: ChatRequest, output: AssistantOutput, usage: Usage, *, message_id: str) -> dict[str, Any]:
    """The non-streaming Messages response: content in the order thinking, text, tool_use."""
    content: list[dict[str, Any]] = []
    if output.thinking:
        signature = thinking_signature(output.thinking)
        content.append({"type": "thinking", "thinking": output.thinking, "signature": signature})
    if output.text:
        content.append({"type": "text", "text": output.text})
    content.extend(_tool_use_block(call) for call in output.tool_calls)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": _stop_reason(output, bool(output.tool_calls)),
        "stop_sequence": None,
        "usage": _usage(usage),
    }


def models_body(names: Sequence[str]) -> dict[str, Any]:
    """`GET /v1/models`: every served model name, one page."""
    data = [
        {"type": "model", "id": name, "display_name": name, "created_at": EPOCH, "lifecycle": "active"}
        for name in names
    ]
    return {
        "data": data,
        "has_more": False,
        "first_id": names[0] if names else None,
        "last_id": names[-1] if names else None,
    }


def _event(payload: dict[str, Any]) -> bytes:
    """One Messages-API stream event: its SSE event name is its `type`."""
    return sse_event(payload, payload["type"])


class StreamWriter:
    """The SSE bytes of one streamed Messages response, built event by event.

    Call `start()` once, `event()` per output event, then exactly one of `finish()` (the answer is complete) or
    `error()` (it failed after the stream started). Consecutive deltas of one kind share a content block; a thinking
    block ends with a `signature_delta`; a tool call is one block with its whole arguments in one `input_json_delta`.
    """

    def __init__(self, request: ChatRequest, *, message_id: str, input_tokens: int):
        self.request = request
        self.message_id = message_id
        self.input_tokens = input_tokens
        self.num_blocks = 0  # content blocks opened so far; the open one, if any, has index num_blocks - 1
        self.open_kind: str | None = None  # "thinking" | "text" while a block is open
        self.thinking_parts: list[str] = []  # the open thinking block's text (its signature is computed at close)
        self.called_tools = False
        self.started = False
        self.done = False

    def start(self) -> bytes:
        assert not self.started, "start() called twice"
        self.started = True
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.input_tokens,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
        return _event({"type": "message_start", "message": message}) + _event({"type": "ping"})

    def keepalive(self) -> bytes:
        """Anthropic's own keep-alive event (its API sends `ping` events while a response is slow to come)."""
        assert self.started and not self.done, "keepalive() outside start() ... finish()/error()"
        return _event({"type": "ping"})

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        index = self.num_blocks - 1
        out = b""
        if self.open_kind == "thinking":
            signature = thinking_signature("".join(self.thinking_parts))
            delta = {"type": "signature_delta", "signature": signature}
            out += _event({"type": "content_block_delta", "index": index, "delta": delta})
            self.thinking_parts = []
        self.open_kind = None
        return out + _event({"type": "content_block_stop", "index": index})

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.num_blocks += 1
        event = {"type": "content_block_start", "index": self.num_blocks - 1, "content_block": block}
        return out + _event(event)

    def _delta(self, kind: str, start_block: dict[str, Any], delta: dict[str, Any]) -> bytes:
        out = b"" if self.open_kind == kind else self._open(start_block)
        self.open_kind = kind
        event = {"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta}
        return out + _event(event)

    def event(self, ev: OutputEvent) -> bytes:
        assert self.started and not self.done, "event() outside start() ... finish()/error()"
        if isinstance(ev, ThinkingDelta):
            if not ev.text:
                return b""
            self.thinking_parts.append(ev.text)
            start_block = {"type": "thinking", "thinking": "", "signature": ""}
            return self._delta("thinking", start_block, {"type": "thinking_delta", "thinking": ev.text})
        if isinstance(ev, TextDelta):
            if not ev.text:
                return b""
            return self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": ev.text})
        if isinstance(ev, ToolCallDone):
            self.called_tools = True
            call = ev.call
            out = self._open({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            index = self.num_blocks - 1
            # The model's own JSON text, byte for byte; "{}" if it is not an object (never crash mid-stream).
            arguments = call.arguments if _tool_input(call.arguments) is not None else "{}"
            delta = {"type": "input_json_delta", "partial_json": arguments}
            out += _event({"type": "content_block_delta", "index": index, "delta": delta})
            return out + _event({"type": "content_block_stop", "index": index})
        raise TypeError(f"unknown output event {ev!r}")

    def finish(self, output: AssistantOutput, usage: Usage) -> bytes:
        """Close the open block and end the message; `output` gives the stop reason, `usage` the token counts."""
        assert self.started and not self.done, "finish() outside start() ... finish()/error()"
        self.done = True
        out = self._close()
        stop_reason = _stop_reason(output, self.called_tools or bool(output.tool_calls))
        delta = {"stop_reason": stop_reason, "stop_sequence": None}
        out += _event({"type": "message_delta", "delta": delta, "usage": _usage(usage)})
        return out + _event({"type": "message_stop"})

    def error(self, error: ApiError) -> bytes:
        """An `error` event for a failure after the stream started; nothing follows it."""
        if self.done:
            return b""
        self.done = True
        return sse_event(error_body(error), "error")


# ----------------------------------------------------------------------------- the dialect


class AnthropicMessages:
    """The Anthropic Messages API as the server holds it (`gyre.proxy.dialects.protocol.Dialect`)."""

    name = "anthropic"
    path = "/v1/messages"
    count_tokens_path = "/v1/messages/count_tokens"
    response_prefix = "msg_"
    call_prefix = "toolu_"
    incremental = True
    history_field = "messages"

    parse_request = staticmethod(parse_request)
    parse_count_tokens = staticmethod(parse_count_tokens)
    count_tokens_body = staticmethod(count_tokens_body)
    error_body = staticmethod(error_body)
    role_signals = staticmethod(role_signals)

    def response_body(
        self, request: ChatRequest, output: AssistantOutput, usage: Usage, *, response_id: str, created: int
    ) -> dict[str, Any]:
        return response_body(request, output, usage, message_id=response_id)

    def stream_writer(self, request: ChatRequest, *, response_id: str, created: int, input_tokens: int) -> StreamWriter:
        return StreamWriter(request, message_id=response_id, input_tokens=input_tokens)

    def lists_models_for(self, headers: Mapping[str, str]) -> bool:
        return "anthropic-version" in headers  # every Anthropic SDK call sends it

    def models_body(self, names: Sequence[str], created: int) -> dict[str, Any]:
        return models_body(names)


ANTHROPIC = AnthropicMessages()
