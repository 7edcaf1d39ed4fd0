"""OpenAI Responses dialect: `POST /v1/responses` as Codex uses it (pure: JSON in, JSON/SSE out).

Contract (the HTTP server calls these; no IO here):
- `parse_request(body, headers, query) -> ChatRequest`: validates the decoded JSON, raises `ApiError` naming the
  offending field (`param="input[3].call_id"`); unknown fields are ignored, unknown *item* types are refused.
- `response_body(...)`, `StreamWriter` (SSE with `event: <type>` lines and increasing `sequence_number`) and
  `error_body` produce the API's own shapes, as the `openai` SDK's types parse them.
- `OPENAI_RESPONSES` is this dialect as the server holds it (`gyre.proxy.dialects.protocol.Dialect`); fields are
  checked, and errors and model listings answered, as in `gyre.proxy.dialects.openai_chat`.

Canonical mapping (see `gyre.proxy.conversation` and docs/harness.md):
- `instructions`, then the first system/developer message when no turn precedes it, joined with "\\n\\n", are
  `ChatRequest.system`; later system/developer messages stay `Turn(role="system")` at their position.
- Consecutive assistant-side items (reasoning, assistant messages, function/custom tool calls) merge into one
  assistant Turn: thinking from reasoning summaries, text from messages, tool calls in order.
- A function in a `namespace` tool group is offered as `<namespace>__<name>` (Codex's canonical flat name) and a
  `function_call` carrying `namespace` is read back under that name; our output splits it again.
- A custom (free-form) tool becomes a function with one string parameter `input`; a `custom_tool_call` reads back as
  arguments `{"input": ...}` in compact JSON, and our calls of custom tools are sent as `custom_tool_call` items.
- Item ids of our output are deterministic from `response_id` (`msg_<id>_<output index>`), so echoes are recognisable.
- `previous_response_id` is refused: nothing is stored; harnesses with `store: false` send the full history.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gyre.proxy.conversation import (
    GYRE_SIGNAL_HEADERS,
    ApiError,
    AssistantOutput,
    ChatRequest,
    OutputEvent,
    ThinkingDelta,
    ToolCall,
    ToolCallDone,
    ToolSpec,
    Turn,
    Usage,
    compact_json,
)
from gyre.proxy.dialects.fields import lower_headers
from gyre.proxy.dialects.incremental import MessageCache
from gyre.proxy.dialects.openai_chat import (
    OpenAIChat,
    check,
    content_text,
    error_body,
    request_body,
    tool_arguments,
    tool_parameters,
)
from gyre.proxy.dialects.protocol import unsent_events
from gyre.proxy.dialects.sse import sse_event

__all__ = ["OPENAI_RESPONSES", "StreamWriter", "error_body", "parse_request", "response_body"]

MEDIA_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}  # refused: text-only models
CUSTOM_TOOL_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
TURN_METADATA_KEYS = ("request_kind", "thread_source", "parent_thread_id")
SIGNAL_HEADERS = ("thread-id", "session_id", "user-agent", "x-openai-subagent", *GYRE_SIGNAL_HEADERS)
# ApiError.kind -> `response.error.code` of a failed streamed response (Codex reads context_length_exceeded).
FAILED_CODES = {"prompt_too_long": "context_length_exceeded", "rate_limit": "rate_limit_exceeded"}


def flat_tool_name(namespace: str, name: str) -> str:
    """Codex's canonical flat name of a namespaced tool (`ToolName::canonical_flat_name`)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


# ----------------------------------------------------------------------------- request: input items


def _parts_text(content: Any, param: str, text_types: tuple[str, ...]) -> str:
    return content_text(content, param, text_types, MEDIA_PARTS)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """Thinking of a reasoning item: its summary texts, or its reasoning_text content when there is no summary."""
    texts = []
    for key, part_type in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(key)
        if parts is None:
            continue
        for j, part in enumerate(check.array(parts, f"{param}.{key}")):
            part_param = f"{param}.{key}[{j}]"
            check.choice(check.object(part, part_param).get("type"), f"{part_param}.type", (part_type, "text"))
            texts.append(check.string(part.get("text"), f"{part_param}.text"))
        if texts:
            break
    return "\n\n".join(texts)


class _HistoryBuilder:
    """Accumulates turns; assistant-side items are buffered and merged into one assistant Turn."""

    def __init__(self, system: str | None):
        self.system = system
        self.system_from_input = False
        self.turns: list[Turn] = []
        self._thinking: list[str] = []
        self._texts: list[str] = []
        self._calls: list[ToolCall] = []

    def flush(self) -> None:
        if self._thinking or self._texts or self._calls:
            self.turns.append(
                Turn(
                    role="assistant",
                    text="\n\n".join(self._texts),
                    thinking="\n\n".join(t for t in self._thinking if t),
                    tool_calls=tuple(self._calls),
                )
            )
        self._thinking, self._texts, self._calls = [], [], []

    def add_system(self, text: str) -> None:
        self.flush()
        if not self.turns and not self.system_from_input:
            self.system_from_input = True
            self.system = text if self.system is None else f"{self.system}\n\n{text}"
        else:
            self.turns.append(Turn(role="system", text=text))

    def add(self, turn: Turn) -> None:
        self.flush()
        self.turns.append(turn)

    def add_assistant(self, *, text: str | None = None, thinking: str | None = None, call: ToolCall | None = None):
        if thinking is not None:
            self._thinking.append(thinking)
        if text is not None:
            self._texts.append(text)
        if call is not None:
            self._calls.append(call)


def _add_item(history: _HistoryBuilder, item: Any, i: int) -> None:
    param = f"input[{i}]"
    kind = check.object(item, param).get("type")
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        role = check.choice(item.get("role"), f"{param}.role", ("user", "assistant", "system", "developer"))
        if role in ("user", "system", "developer"):
            text = _parts_text(item.get("content"), f"{param}.content", ("input_text",))
            if role == "user":
                history.add(Turn(role="user", text=text))
            else:
                history.add_system(text)
        else:
            text = _parts_text(item.get("content"), f"{param}.content", ("output_text", "input_text"))
            history.add_assistant(text=text)
    elif kind == "reasoning":
        history.add_assistant(thinking=_reasoning_text(item, param))
    elif kind == "function_call":
        name = check.string(item.get("name"), f"{param}.name", non_empty=True)
        namespace = check.optional_string(item.get("namespace"), f"{param}.namespace")
        call = ToolCall(
            id=check.string(item.get("call_id"), f"{param}.call_id", non_empty=True),
            name=flat_tool_name(namespace, name) if namespace else name,
            arguments=tool_arguments(item.get("arguments"), f"{param}.arguments"),
        )
        history.add_assistant(call=call)
    elif kind == "custom_tool_call":
        call = ToolCall(
            id=check.string(item.get("call_id"), f"{param}.call_id", non_empty=True),
            name=check.string(item.get("name"), f"{param}.name", non_empty=True),
            arguments=compact_json({"input": check.string(item.get("input"), f"{param}.input")}),
        )
        history.add_assistant(call=call)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        history.add(
            Turn(
                role="tool",
                text=_parts_text(item.get("output"), f"{param}.output", ("input_text", "output_text")),
                tool_call_id=check.string(item.get("call_id"), f"{param}.call_id", non_empty=True),
            )
        )
    else:
        raise check.invalid(f"{param}.type", f"input item type {kind!r} is not supported by this server")


# ----------------------------------------------------------------------------- request: tools and signals


def _function_spec(tool: dict[str, Any], param: str, name_prefix: str | None) -> ToolSpec:
    name = check.string(tool.get("name"), f"{param}.name", non_empty=True)
    description = check.optional_string(tool.get("description"), f"{param}.description") or ""
    if tool.get("type") == "custom":
        parameters = CUSTOM_TOOL_PARAMETERS
    else:
        parameters = tool_parameters(tool.get("parameters"), f"{param}.parameters")
    return ToolSpec(
        name=flat_tool_name(name_prefix, name) if name_prefix else name, description=description, parameters=parameters
    )


def _tools(value: Any) -> tuple[tuple[ToolSpec, ...], list[str], dict[str, list[str]], list[dict[str, Any]]]:
    """(specs, names of custom tools, flat name -> [namespace, name], the tools as echoed in the response)."""
    if value is None:
        return (), [], {}, []
    specs: list[ToolSpec] = []
    custom: list[str] = []
    namespaced: dict[str, list[str]] = {}
    echoed: list[dict[str, Any]] = []
    for i, tool in enumerate(check.array(value, "tools")):
        param = f"tools[{i}]"
        kind = check.object(tool, param).get("type")
        if kind in ("function", "custom"):
            spec = _function_spec(tool, param, None)
            specs.append(spec)
            echoed.append(_echo_tool(kind, spec))
            if kind == "custom":
                custom.append(spec.name)
        elif kind == "namespace":
            namespace = check.string(tool.get("name"), f"{param}.name", non_empty=True)
            echoed_members = []
            for j, member in enumerate(check.array(tool.get("tools"), f"{param}.tools")):
                member_param = f"{param}.tools[{j}]"
                if check.object(member, member_param).get("type") not in ("function", "custom"):
                    continue
                spec = _function_spec(member, member_param, namespace)
                specs.append(spec)
                inner = ToolSpec(name=member["name"], description=spec.description, parameters=spec.parameters)
                echoed_members.append(_echo_tool(member["type"], inner))
                namespaced[spec.name] = [namespace, member["name"]]
                if member["type"] == "custom":
                    custom.append(spec.name)
            description = check.optional_string(tool.get("description"), f"{param}.description") or ""
            echoed.append({"type": "namespace", "name": namespace, "description": description, "tools": echoed_members})
        # hosted tools (web_search, file_search, local_shell, ...) are not offered to the model
    return tuple(specs), custom, namespaced, echoed


def _echo_tool(kind: str, spec: ToolSpec) -> dict[str, Any]:
    if kind == "custom":
        return {"type": "custom", "name": spec.name, "description": spec.description}
    return {
        "type": "function",
        "name": spec.name,
        "description": spec.description,
        "parameters": spec.parameters,
        "strict": False,
    }


def _turn_metadata(raw: Any) -> dict[str, Any]:
    """The `x-codex-turn-metadata` JSON (header, or `client_metadata` in the body); {} when absent or invalid."""
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return {}
    return raw if isinstance(raw, dict) else {}


def _signals(body: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    hdrs = lower_headers(headers)
    metadata = _turn_metadata(hdrs.get("x-codex-turn-metadata"))
    client_metadata = body.get("client_metadata")
    if not metadata and isinstance(client_metadata, dict):
        metadata = _turn_metadata(client_metadata.get("x-codex-turn-metadata", client_metadata))
    signals: dict[str, Any] = {k: metadata[k] for k in TURN_METADATA_KEYS if k in metadata}
    signals.update({k: hdrs[k] for k in SIGNAL_HEADERS if k in hdrs})
    if isinstance(body.get("prompt_cache_key"), str):
        signals["prompt_cache_key"] = body["prompt_cache_key"]
    return signals


def parse_request(body: Any, headers: Mapping[str, str], query: Mapping[str, str]) -> ChatRequest:
    """A Responses request body as a ChatRequest; ApiError (invalid_request) names the bad field.

    Not incremental (unlike the other dialects): input items merge across item boundaries (reasoning, message and
    function calls into one assistant turn), so the whole input is parsed each call."""
    del query  # no query parameters in this API
    body = request_body(body)
    model = check.string(body.get("model"), "model", non_empty=True)
    if body.get("previous_response_id") is not None:
        raise check.invalid(
            "previous_response_id",
            "not supported (this server stores no responses); send the whole conversation in `input` (store: false)",
        )
    instructions = check.optional_string(body.get("instructions"), "instructions")
    history = _HistoryBuilder(instructions or None)  # "" is no system prompt
    items = body.get("input")
    if isinstance(items, str):
        history.add(Turn(role="user", text=check.text(items, "input")))
    elif isinstance(items, list):
        for i, item in enumerate(items):
            _add_item(history, item, i)
        history.flush()
    else:
        raise check.wrong_type("input", "a string or an array of items", items)
    if not history.turns:
        raise check.invalid("input", "must contain at least one message or item besides the system prompt")

    reasoning = check.optional_object(body.get("reasoning"), "reasoning")
    effort = check.optional_string((reasoning or {}).get("effort"), "reasoning.effort")
    summary = check.optional_string((reasoning or {}).get("summary"), "reasoning.summary")
    parallel_tool_calls = check.optional_bool(body.get("parallel_tool_calls"), "parallel_tool_calls")
    store = check.optional_bool(body.get("store"), "store")
    metadata = check.optional_object(body.get("metadata"), "metadata")
    tool_choice = body.get("tool_choice", "auto")
    if not isinstance(tool_choice, str | dict):
        raise check.wrong_type("tool_choice", "a string or an object", tool_choice)
    specs, custom, namespaced, echoed_tools = _tools(body.get("tools"))
    max_tokens = check.optional_int(body.get("max_output_tokens"), "max_output_tokens", low=1)
    temperature = check.optional_number(body.get("temperature"), "temperature", low=0.0, high=2.0)
    top_p = check.optional_number(body.get("top_p"), "top_p", low=0.0, high=1.0)
    echo = {
        "instructions": instructions,
        "metadata": metadata,
        "tool_choice": tool_choice,
        "parallel_tool_calls": True if parallel_tool_calls is None else parallel_tool_calls,
        "tools": echoed_tools,
        "reasoning": None if reasoning is None else {"effort": effort, "summary": summary},
        "max_output_tokens": max_tokens,
        "store": store,
        "prompt_cache_key": body.get("prompt_cache_key") if isinstance(body.get("prompt_cache_key"), str) else None,
        "custom_tools": custom,
        "namespaced_tools": namespaced,
    }
    return ChatRequest(
        dialect="openai_responses",
        model=model,
        system=history.system,
        turns=tuple(history.turns),
        tools=specs,
        stream=check.optional_bool(body.get("stream"), "stream") or False,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        thinking=reasoning is not None and effort != "none",
        signals=_signals(body, headers),
        echo=echo,
    )


# ----------------------------------------------------------------------------- response objects


def _id_base(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def _reasoning_item(item_id: str, thinking: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": thinking}]}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call_item(request: ChatRequest, item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    """A function_call item, or a custom_tool_call item when the model called a custom (free-form) tool."""
    name = call.name
    namespace = None
    if call.name in request.echo.get("namespaced_tools", {}):
        namespace, name = request.echo["namespaced_tools"][call.name]
    if call.name in request.echo.get("custom_tools", ()):
        item = {
            "id": item_id,
            "type": "custom_tool_call",
            "call_id": call.id,
            "name": name,
            "input": _custom_input(call),
        }
    else:
        item = {
            "id": item_id,
            "type": "function_call",
            "call_id": call.id,
            "name": name,
            "arguments": call.arguments,
            "status": status,
        }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _custom_input(call: ToolCall) -> str:
    """The free-form input of a custom tool call: the `input` argument, or the raw arguments if there is none."""
    try:
        arguments = orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        return call.arguments
    if isinstance(arguments, dict) and isinstance(arguments.get("input"), str):
        return arguments["input"]
    return call.arguments


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


def _response(
    request: ChatRequest,
    *,
    response_id: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    echo = request.echo
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo.get("instructions"),
        "metadata": echo.get("metadata") or {},
        "model": request.model,
        "output": output,
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools", []),
        "max_output_tokens": request.max_tokens,
        "previous_response_id": None,
        "reasoning": echo.get("reasoning"),
        "store": echo.get("store"),
        "prompt_cache_key": echo.get("prompt_cache_key"),
        "truncation": "disabled",
        "usage": None if usage is None else _usage(usage),
    }


def _status(output: AssistantOutput) -> str:
    return "incomplete" if output.stop_reason == "length" else "completed"


def response_body(
    request: ChatRequest, output: AssistantOutput, usage: Usage, *, response_id: str, created: int
) -> dict[str, Any]:
    """The non-streaming `response` object: reasoning, message and tool-call items in that order."""
    base = _id_base(response_id)
    status = _status(output)
    items: list[dict[str, Any]] = []
    if output.thinking:
        items.append(_reasoning_item(f"rs_{base}_{len(items)}", output.thinking))
    if output.text:
        items.append(_message_item(f"msg_{base}_{len(items)}", output.text, status))
    for call in output.tool_calls:
        prefix = "ctc" if call.name in request.echo.get("custom_tools", ()) else "fc"
        items.append(_call_item(request, f"{prefix}_{base}_{len(items)}", call))
    return _response(request, response_id=response_id, created=created, status=status, output=items, usage=usage)


# ----------------------------------------------------------------------------- streaming


class StreamWriter:
    """SSE events of one streamed response: created/in_progress, one item at a time, completed (or failed).

    Thinking opens a reasoning item, text a message item, each tool call is one complete item; a new kind of output
    closes the open item. `finish` first sends whatever of `output` the events did not carry, so the items of
    `response.completed` equal `response_body` for the same output (when thinking precedes text, as models emit it).
    """

    def __init__(self, request: ChatRequest, *, response_id: str, created: int, input_tokens: int):
        self.request = request
        self.response_id = response_id
        self.created = created
        self._base = _id_base(response_id)
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # finished items, in output order
        self._open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self._open_text = ""
        self._text = ""  # all text / thinking sent so far (for finish's catch-up)
        self._thinking = ""
        self._num_tool_calls = 0

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(payload, kind)

    def _snapshot(self, status: str, usage: Usage | None = None, error: dict[str, Any] | None = None) -> dict:
        return _response(
            self.request,
            response_id=self.response_id,
            created=self.created,
            status=status,
            output=list(self._items),
            usage=usage,
            error=error,
        )

    def start(self) -> bytes:
        return self._event("response.created", response=self._snapshot("in_progress")) + self._event(
            "response.in_progress", response=self._snapshot("in_progress")
        )

    def keepalive(self) -> bytes:
        """`response.in_progress` again: Codex times an idle stream by its events (an SSE comment does not count:
        with one every 2 s its 5-s `stream_idle_timeout_ms` still fired), and the event says only what is true."""
        return self._event("response.in_progress", response=self._snapshot("in_progress"))

    def _open_item(self, kind: str) -> bytes:
        out = self._close_item()
        index = len(self._items)
        if kind == "reasoning":
            self._open = {"id": f"rs_{self._base}_{index}", "type": "reasoning", "summary": []}
            out += self._event("response.output_item.added", output_index=index, item=self._open)
            out += self._event(
                "response.reasoning_summary_part.added",
                item_id=self._open["id"],
                output_index=index,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
        else:
            self._open = {**_message_item(f"msg_{self._base}_{index}", "", "in_progress"), "content": []}
            out += self._event("response.output_item.added", output_index=index, item=self._open)
            out += self._event(
                "response.content_part.added",
                item_id=self._open["id"],
                output_index=index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            )
        self._open_text = ""
        return out

    def _close_item(self, status: str = "completed") -> bytes:
        if self._open is None:
            return b""
        item_id, index, text = self._open["id"], len(self._items), self._open_text
        if self._open["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            out = self._event(
                "response.reasoning_summary_text.done", item_id=item_id, output_index=index, summary_index=0, text=text
            )
            out += self._event(
                "response.reasoning_summary_part.done", item_id=item_id, output_index=index, summary_index=0, part=part
            )
            item = _reasoning_item(item_id, text)
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            common = {"item_id": item_id, "output_index": index, "content_index": 0}
            out = self._event("response.output_text.done", **common, text=text, logprobs=[])
            out += self._event("response.content_part.done", **common, part=part)
            item = _message_item(item_id, text, status)
        out += self._event("response.output_item.done", output_index=index, item=item)
        self._items.append(item)
        self._open = None
        return out

    def event(self, ev: OutputEvent) -> bytes:
        if isinstance(ev, ToolCallDone):
            return self._tool_call(ev.call)
        if not ev.text:
            return b""
        kind = "reasoning" if isinstance(ev, ThinkingDelta) else "message"
        out = b"" if self._open is not None and self._open["type"] == kind else self._open_item(kind)
        self._open_text += ev.text
        index, item_id = len(self._items), self._open["id"]
        if kind == "reasoning":
            self._thinking += ev.text
            return out + self._event(
                "response.reasoning_summary_text.delta",
                item_id=item_id,
                output_index=index,
                summary_index=0,
                delta=ev.text,
            )
        self._text += ev.text
        return out + self._event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=ev.text,
            logprobs=[],
        )

    def _tool_call(self, call: ToolCall) -> bytes:
        out = self._close_item()
        index = len(self._items)
        custom = call.name in self.request.echo.get("custom_tools", ())
        item = _call_item(self.request, f"{'ctc' if custom else 'fc'}_{self._base}_{index}", call)
        self._num_tool_calls += 1
        if custom:
            out += self._event("response.output_item.added", output_index=index, item={**item, "input": ""})
            common = {"item_id": item["id"], "output_index": index}
            out += self._event("response.custom_tool_call_input.delta", **common, delta=item["input"])
            out += self._event("response.custom_tool_call_input.done", **common, input=item["input"])
        else:
            added = {**item, "arguments": "", "status": "in_progress"}
            out += self._event("response.output_item.added", output_index=index, item=added)
            common = {"item_id": item["id"], "output_index": index}
            out += self._event("response.function_call_arguments.delta", **common, delta=call.arguments)
            out += self._event("response.function_call_arguments.done", **common, arguments=call.arguments)
        out += self._event("response.output_item.done", output_index=index, item=item)
        self._items.append(item)
        return out

    def finish(self, output: AssistantOutput, usage: Usage) -> bytes:
        unsent = unsent_events(output, thinking=self._thinking, text=self._text, num_tool_calls=self._num_tool_calls)
        out = b"".join(self.event(event) for event in unsent)
        status = _status(output)
        out += self._close_item(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, response=self._snapshot(status, usage))

    def error(self, error: ApiError) -> bytes:
        """An `error` event, then `response.failed` carrying the error (what Codex reads to decide what to do)."""
        body = error_body(error)["error"]
        code = FAILED_CODES.get(error.kind, "server_error" if error.status >= 500 else "invalid_prompt")
        out = self._event("error", code=body["code"], message=error.message, param=error.param)
        failed = self._snapshot("failed", error={"code": code, "message": error.message})
        return out + self._event("response.failed", response=failed)


# ----------------------------------------------------------------------------- the dialect


class OpenAIResponses(OpenAIChat):
    """The OpenAI Responses API as the server holds it (`gyre.proxy.dialects.protocol.Dialect`); its error shape,
    model listing and role signals are the Chat Completions dialect's."""

    name = "openai_responses"
    path = "/v1/responses"
    response_prefix = "resp_"
    incremental = False  # input items merge across item boundaries: the whole input is parsed each call
    history_field = "input"

    response_body = staticmethod(response_body)
    stream_writer = StreamWriter

    def parse_request(
        self, body: Any, headers: Mapping[str, str], query: Mapping[str, str], *, cache: MessageCache | None
    ) -> ChatRequest:
        assert cache is None, "the Responses dialect is not incremental"
        return parse_request(body, headers, query)

    def lists_models_for(self, headers: Mapping[str, str]) -> bool:
        return False  # the Chat dialect answers OpenAI's listings, in the one shape both OpenAI APIs share


OPENAI_RESPONSES = OpenAIResponses()
