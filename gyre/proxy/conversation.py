"""The proxy's dialect-free view of a model call: what every API dialect parses into and formats out of.

Role: the three dialects (`gyre.proxy.dialects.anthropic`, `.openai_chat`, `.openai_responses`) turn a request body
into a `ChatRequest` and turn an `AssistantOutput` (or a stream of `OutputEvent`s) back into their own JSON and SSE.
Templating (`gyre.proxy.render`) sees only `ChatRequest`; output parsing (`gyre.proxy.output`) produces only
`AssistantOutput` / `OutputEvent`. Pure: stdlib only, no IO.

Canonical content (docs/harness.md: match histories on content, not on ids or cache markers):
- text blocks of one message are joined with "\\n\\n"; `cache_control`, signatures, citations and ids of messages
  are dropped here (dialects keep what they must echo elsewhere);
- tool-call arguments are kept as the JSON text the model produced when they come from us (so an echo compares
  equal byte for byte) and as compact JSON (`json.dumps(..., separators=(",", ":"))`) when a client sends an object;
- a mid-conversation system message stays a `Turn(role="system")` at its position; the leading system prompt is
  `ChatRequest.system`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
# Why the model stopped, in dialect-free terms: "stop" (end of turn), "tool_calls" (ended after calling tools),
# "length" (max tokens), "abort" (cancelled: only seen when the proxy could not complete a call).
StopReason = Literal["stop", "tool_calls", "length", "abort"]
# Headers any harness may send, in every dialect, to state the role of a call (gyre's builtin harness always does):
# `x-gyre-role` is one of the four role labels of `gyre.traj.roles.Role` (main, main-summary, sub-agent,
# sub-agent-summary); `x-gyre-agent-id` names a sub-agent's conversation thread (its own prompt builder).
GYRE_SIGNAL_HEADERS = ("x-gyre-role", "x-gyre-agent-id")


class ApiError(Exception):
    """A client error answered in the dialect's own error shape (never a traceback, never recorded).

    `kind` is dialect-free; each dialect maps it to its type names: invalid_request (400), authentication (401),
    permission (403), not_found (404), request_timeout (408: the body did not arrive in time),
    request_too_large (413), rate_limit (429), overloaded (503/529),
    api_error (500). `prompt_too_long` is an invalid_request whose message starts with "prompt is too long"
    (what makes Claude Code compact).
    """

    STATUS: ClassVar[dict[str, int]] = {
        "invalid_request": 400,
        "prompt_too_long": 400,
        "authentication": 401,
        "permission": 403,
        "not_found": 404,
        "request_timeout": 408,
        "request_too_large": 413,
        "rate_limit": 429,
        "overloaded": 503,
        "api_error": 500,
    }

    def __init__(self, kind: str, message: str, *, param: str | None = None):
        if kind not in self.STATUS:
            raise ValueError(f"unknown ApiError kind {kind!r}; expected one of {sorted(self.STATUS)}")
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param  # the offending field, e.g. "messages.3.content" (OpenAI reports it)

    @property
    def status(self) -> int:
        return self.STATUS[self.kind]


def compact_json(value: Any) -> str:
    """The canonical JSON text of a client-sent object (tool-call arguments, tool schemas)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One function call by the assistant. `id` is ours when we produced it (the payload-cache key)."""

    id: str
    name: str
    arguments: str  # JSON text (see the module docstring)


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One message of the conversation, canonical."""

    role: Role
    text: str = ""
    thinking: str = ""  # assistant reasoning (Anthropic thinking blocks, Responses reasoning summaries)
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    tool_call_id: str | None = None  # tool only: the call this result answers
    is_error: bool = False  # tool only: the tool failed

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is not allowed: expected one of {ROLES}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} turn cannot carry tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool turn needs the tool_call_id it answers")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    """A function the client offers: name, description and JSON-schema parameters."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def as_template_tool(self) -> dict[str, Any]:
        """The OpenAI-style `{"type": "function", "function": {...}}` that HF chat templates render."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """A parsed model call. Sampling fields are what the client asked for; the server decides what it honours."""

    dialect: Literal["anthropic", "openai_chat", "openai_responses"]
    model: str
    system: str | None  # the leading system (or developer) prompt; None if there is none
    turns: tuple[Turn, ...]
    tools: tuple[ToolSpec, ...] = ()
    stream: bool = False
    max_tokens: int | None = None  # the client's cap on output tokens
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()  # stop sequences (text)
    include_usage: bool = True  # OpenAI Chat streaming: stream_options.include_usage
    thinking: bool = False  # the client asked for reasoning / thinking output
    signals: dict[str, Any] = field(default_factory=dict)  # role signals (headers, request kind, agent id)
    echo: dict[str, Any] = field(default_factory=dict)  # dialect fields to echo back (metadata, previous ids, ...)

    def __post_init__(self) -> None:
        object.__setattr__(self, "turns", tuple(self.turns))
        object.__setattr__(self, "tools", tuple(self.tools))
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True, kw_only=True)
class Usage:
    input_tokens: int  # prompt tokens the engine saw, cached ones included (OpenAI's prompt_tokens)
    output_tokens: int
    cached_tokens: int = 0  # of input_tokens, those whose KV was reused (Anthropic reports input - cached)


@dataclass(frozen=True, kw_only=True)
class AssistantOutput:
    """The model's answer, parsed from its output tokens (`gyre.proxy.output`)."""

    text: str = ""
    thinking: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    stop_reason: StopReason = "stop"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))


# ----------------------------------------------------------------------------- streaming events


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ThinkingDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDone:
    """A complete tool call (the parser emits a call once its closing tag arrived and its JSON parsed)."""

    call: ToolCall


OutputEvent = TextDelta | ThinkingDelta | ToolCallDone
