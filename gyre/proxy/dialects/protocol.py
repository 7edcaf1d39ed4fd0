"""What the proxy's server holds a dialect by: the `Dialect` protocol and the `StreamWriter` it makes.

Contract: a dialect is one object (`anthropic.ANTHROPIC`, `openai_chat.OPENAI_CHAT`,
`openai_responses.OPENAI_RESPONSES`; all of them in `gyre.proxy.dialects.DIALECTS`) that turns its API's request
JSON into the proxy's neutral `ChatRequest` and an `AssistantOutput` back into its API's JSON or SSE bytes. Pure: no
IO; the server (`gyre.proxy.server`) reads bodies, authenticates, routes and writes what these methods return. The
server has no per-dialect branch: what differs between the APIs (routes, id prefixes, error shapes, usage fields,
model listings, role signals) is a method or an attribute here.

A client error is `ApiError` (`gyre.proxy.conversation`); field errors come from the dialect's `FieldChecks`
(`gyre.proxy.dialects.fields`); `error_body` answers either in the API's own error shape, with `error.status`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gyre.proxy.conversation import (
    ApiError,
    AssistantOutput,
    ChatRequest,
    OutputEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDone,
    Usage,
)
from gyre.proxy.dialects.incremental import MessageCache
from gyre.traj.roles import is_claude_code_summary_request


class StreamWriter(Protocol):
    """The SSE bytes of one streamed response: `start()` once, `event()` per output event, then exactly one of
    `finish()` (the answer is complete: `output` is what the events added up to) or `error()` (a failure after
    the stream started; nothing follows it). `keepalive()` may come between `start()` and the first `event()`,
    while the first tokens are awaited (a long prefill: docs/proxy.md, "Long prefills")."""

    def start(self) -> bytes: ...

    def keepalive(self) -> bytes: ...

    def event(self, ev: OutputEvent) -> bytes: ...

    def finish(self, output: AssistantOutput, usage: Usage) -> bytes: ...

    def error(self, error: ApiError) -> bytes: ...


class Dialect(Protocol):
    """One API dialect as the server holds it."""

    name: str  # `ChatRequest.dialect` of what it parses; names its parse caches
    path: str  # the route of its model calls (POST)
    count_tokens_path: str | None  # the route of its token counting (POST), None when the API has none
    response_prefix: str  # of the response / message id the server makes for each call
    call_prefix: str  # of the tool-call ids the output parser makes
    incremental: bool  # parse_request reuses a thread's unchanged messages from a `MessageCache`
    history_field: str  # the body's array a harness resends whole each call (`gyre.proxy.body_reuse`)

    def parse_request(
        self, body: Any, headers: Mapping[str, str], query: Mapping[str, str], *, cache: MessageCache | None
    ) -> ChatRequest:
        """The decoded JSON body of a call (headers with lower-case names) as a `ChatRequest`, or `ApiError`.
        `cache` is the thread's (given only when `incremental`)."""
        ...

    def parse_count_tokens(self, body: Any, headers: Mapping[str, str], query: Mapping[str, str]) -> ChatRequest:
        """The body of a token-counting request (only when `count_tokens_path` is set)."""
        ...

    def count_tokens_body(self, input_tokens: int) -> dict[str, Any]: ...

    def response_body(
        self, request: ChatRequest, output: AssistantOutput, usage: Usage, *, response_id: str, created: int
    ) -> dict[str, Any]:
        """The non-streaming response; `created` is the call's start in Unix seconds."""
        ...

    def stream_writer(self, request: ChatRequest, *, response_id: str, created: int, input_tokens: int) -> StreamWriter:
        """A writer for the streamed response of one call; its bytes reassemble to `response_body`'s."""
        ...

    def error_body(self, error: ApiError) -> dict[str, Any]:
        """The API's error shape for `error` (the HTTP status is `error.status`)."""
        ...

    def lists_models_for(self, headers: Mapping[str, str]) -> bool:
        """Whether `GET /v1/models` with these headers (lower-case names) is answered in this dialect's shape."""
        ...

    def models_body(self, names: Sequence[str], created: int) -> dict[str, Any]:
        """`GET /v1/models`: the served model names."""
        ...

    def role_signals(self, request: ChatRequest) -> dict[str, Any]:
        """What the call's record keeps for the role classifiers (`gyre.traj.roles`): `stated_role_signals` plus
        what the dialect's harnesses tell apart by."""
        ...


def stated_role_signals(request: ChatRequest) -> dict[str, Any]:
    """The signals every dialect records alike, read from the content, not from the API it came in: the request's
    signals, `gyre_role` when the harness stated its role (`x-gyre-role`; gyre's builtin harness always does: see
    `gyre.proxy.conversation.GYRE_SIGNAL_HEADERS`), and `summary_request` when the last user turn is a compaction
    instruction (`gyre.traj.roles.is_claude_code_summary_request`), so the same conversation is classified the
    same whether it came over the Anthropic or an OpenAI API (docs/trajectories.md)."""
    signals = dict(request.signals)
    role = signals.get("x-gyre-role")
    if role:
        signals["gyre_role"] = role
    last_user = next((turn for turn in reversed(request.turns) if turn.role == "user"), None)
    if last_user is not None and is_claude_code_summary_request(last_user.text):
        signals["summary_request"] = True
    return signals


def unsent_events(output: AssistantOutput, *, thinking: str, text: str, num_tool_calls: int) -> list[OutputEvent]:
    """The events that carry what of `output` a stream has not sent, given the `thinking` and `text` it sent and
    its first `num_tool_calls` tool calls: a writer's `finish` sends them, so the stream adds up to `output`."""
    events: list[OutputEvent] = []
    if output.thinking.startswith(thinking):
        events.append(ThinkingDelta(output.thinking[len(thinking) :]))
    if output.text.startswith(text):
        events.append(TextDelta(output.text[len(text) :]))
    events.extend(ToolCallDone(call) for call in output.tool_calls[num_tool_calls:])
    return events
