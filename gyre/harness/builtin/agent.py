"""The builtin harness's agent loop: model backends (Anthropic Messages, OpenAI Chat Completions), tool turns,
compaction, sub-agent delegation and retries.

Contract:
- `Agent.run(task)` loops: call the model with the history, run the tool calls it makes, append their results,
  until it answers without tool calls (`status="answered"`) or `max_turns` model turns were made
  (`status="max_turns"`). A refused request (4xx other than prompt-too-long, or retries exhausted) raises
  `ModelCallError`.
- Every call carries header `x-gyre-role` (main, main-summary, sub-agent, sub-agent-summary) and, in a
  sub-agent, `x-gyre-agent-id` (docs/proxy.md, "Role headers").
- Compaction: before a call, when the previous call's reported tokens reached `compact_fraction` of
  `context_limit` or when `force_compaction_after` main turns passed since the start or the last compaction;
  and when the API answers 400 "prompt is too long". A summary request (the history plus a summary
  instruction; role `*-summary`) is sent, then the history restarts as: the task with the summary, then the
  last `keep_tail` (assistant, tool results) exchanges verbatim. A second consecutive prompt-too-long
  compacts without a tail; a third is fatal.
- Delegation: the `delegate` tool runs a sub-agent (own history, no `delegate` tool, its own agent id) and
  returns its final text. `force_delegation` makes the main agent's first turn a delegation of the task,
  written into the history as a tool call the harness made (the model never produced it).
- Transient failures (connection errors, timeouts, 429, 5xx) are retried `max_retries` times with capped
  exponential backoff.
The transcript (one JSON object per line) records every model turn, tool result and compaction.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, TextIO

from gyre.config.harness import AgentConfig
from gyre.harness.builtin.tools import ToolBox, ToolError, ToolResult, parse_arguments

log = logging.getLogger(__name__)

ROLE_HEADER, AGENT_ID_HEADER = "x-gyre-role", "x-gyre-agent-id"
DELEGATE = "delegate"
PROMPT_TOO_LONG = "prompt is too long"

MAIN_SYSTEM = (
    "You are an agent working in a workspace directory. Use the tools to inspect and change files and to run "
    "commands. When the task is done, answer with a short final message and no tool calls."
)
SUB_AGENT_SYSTEM = (
    "You are a sub-agent working in a workspace directory on a task another agent gave you. Use the tools, then "
    "answer with your findings as a short final message and no tool calls."
)
SUMMARY_INSTRUCTION = (
    "Your context is nearly full. Write a detailed summary of the conversation so far: the task, what was done, "
    "what was found, and what remains. Do not call tools. Answer as <summary>...</summary>."
)
CONTINUATION = "This session continues a previous conversation that ran out of context. Summary of it:\n"
DELEGATE_SCHEMA = {
    "type": "object",
    "properties": {"task": {"type": "string", "description": "what the sub-agent should do and report back"}},
    "required": ["task"],
}


class ModelCallError(RuntimeError):
    """The API refused a request (or kept failing): the run cannot go on."""


class PromptTooLongError(Exception):
    """The API answered 400 "prompt is too long": compact and retry."""


class TransientError(Exception):
    """A failure worth retrying (connection, timeout, 429, 5xx)."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str | Mapping[str, Any] | None  # JSON text (OpenAI) or an object (Anthropic)


@dataclass(frozen=True)
class Reply:
    """One assistant turn: what the agent acts on, and `raw`, the message echoed back verbatim next time."""

    text: str
    tool_calls: tuple[ToolCall, ...]
    raw: dict[str, Any]
    input_tokens: int = 0  # the whole prompt, cached parts included
    output_tokens: int = 0
    stop_reason: str = ""


# History items, dialect-free; a backend renders them into its own messages.
@dataclass(frozen=True)
class UserTurn:
    text: str


@dataclass(frozen=True)
class ToolResults:
    results: tuple[tuple[str, ToolResult], ...]  # (tool call id, result)


Turn = UserTurn | Reply | ToolResults


@dataclass(frozen=True)
class ToolSchema:
    name: str
    description: str
    input_schema: Mapping[str, Any]


class Backend:
    """One SDK. `complete` sends system + history + tools with the role headers; maps SDK errors to ours."""

    def complete(self, system: str, history: list[Turn], tools: list[ToolSchema], headers: Mapping[str, str]) -> Reply:
        raise NotImplementedError

    def synthetic_call(self, call: ToolCall) -> Reply:
        """An assistant turn that makes `call` (for `force_delegation`)."""
        raise NotImplementedError


def _map_error(sdk: Any, err: Exception) -> Exception:
    """One of ours for an SDK exception: transient, prompt-too-long, or fatal."""
    if isinstance(err, sdk.APIConnectionError):  # includes APITimeoutError
        return TransientError(f"connection failed: {err}")
    if isinstance(err, sdk.APIStatusError):
        return _status_error(err.status_code, str(err.message))
    return err


def _status_error(status: int, message: str) -> Exception:
    """One of ours for an HTTP error status: transient (429, 5xx), prompt-too-long, or fatal."""
    if status == 429 or status >= 500:
        return TransientError(f"HTTP {status}: {message}")
    if status in (400, 413) and (PROMPT_TOO_LONG in message.lower() or "context_length_exceeded" in message):
        return PromptTooLongError(message)
    return ModelCallError(f"the model API refused the request: HTTP {status}: {message}")


def import_sdk(name: str) -> ModuleType:
    """The `openai` or `anthropic` SDK, imported without aiohttp: both import it eagerly when it is installed (for
    their optional async transport; gyre's proxy installs it), 0.15-0.3 CPU s of every harness process, and the
    agent uses their sync clients only. While the SDK imports, `import aiohttp` fails (an ImportError, which the
    SDKs catch: their async aiohttp client then says it is missing); afterwards it imports as usual."""
    if "aiohttp" in sys.modules:
        return importlib.import_module(name)
    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # Python's way to make an import fail
    try:
        return importlib.import_module(name)
    finally:
        if sys.modules.get("aiohttp", 0) is None:
            del sys.modules["aiohttp"]


def prompt_tokens(usage: Any) -> int:
    """The whole prompt of an Anthropic Messages call: `input_tokens` counts only what was not read from or
    written to the prompt cache, so the cached parts are added back (gyre's proxy reports the reused prefix as
    `cache_read_input_tokens`; docs/proxy.md). Compaction compares this with the context limit."""
    cached = (getattr(usage, "cache_read_input_tokens", 0) or 0) + (
        getattr(usage, "cache_creation_input_tokens", 0) or 0
    )
    return usage.input_tokens + cached


class AnthropicBackend(Backend):
    def __init__(self, *, model: str, max_tokens: int, timeout_s: float, base_url: str | None, api_key: str | None):
        anthropic = import_sdk("anthropic")
        self.sdk = anthropic
        # max_retries=0: retries are ours (bounded, logged). An explicit timeout also disables the SDK's refusal
        # of large non-streaming max_tokens.
        self.client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.model, self.max_tokens = model, max_tokens

    def render(self, history: list[Turn]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        for turn in history:
            if isinstance(turn, Reply):
                messages.append(turn.raw)
                continue
            if isinstance(turn, UserTurn):
                blocks = [{"type": "text", "text": turn.text}]
            else:
                blocks = [
                    {"type": "tool_result", "tool_use_id": i, "content": r.text, "is_error": r.is_error}
                    for i, r in turn.results
                ]
            if messages and messages[-1]["role"] == "user":  # e.g. tool results + the summary instruction
                messages[-1] = {"role": "user", "content": [*messages[-1]["content"], *blocks]}
            else:
                messages.append({"role": "user", "content": blocks})
        return messages

    def complete(self, system, history, tools, headers) -> Reply:
        try:
            message = self.client.messages.create(
                model=self.model,
                max_tokens=self.max_tokens,
                system=system,
                messages=self.render(history),
                tools=[{"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in tools],
                extra_headers=dict(headers),
            )
        except self.sdk.APIError as err:
            raise _map_error(self.sdk, err) from err
        blocks = [block.model_dump(exclude_none=True) for block in message.content]
        return Reply(
            text="".join(b["text"] for b in blocks if b["type"] == "text"),
            tool_calls=tuple(ToolCall(b["id"], b["name"], b.get("input")) for b in blocks if b["type"] == "tool_use"),
            raw={"role": "assistant", "content": blocks or [{"type": "text", "text": "(empty)"}]},
            input_tokens=prompt_tokens(message.usage),
            output_tokens=message.usage.output_tokens,
            stop_reason=str(message.stop_reason),
        )

    def synthetic_call(self, call: ToolCall) -> Reply:
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        return Reply(text="", tool_calls=(call,), raw={"role": "assistant", "content": [block]})


class AnthropicHTTPBackend(AnthropicBackend):
    """The Anthropic Messages API over the standard library's HTTP client, no SDK: the same requests, replies and
    error mapping as `AnthropicBackend` (which gyre's proxy cannot tell apart but for the SDK's own headers), and a
    harness process that starts in ~0.1 CPU s where importing the `anthropic` SDK takes ~1.6 (docs/harness.md,
    "The builtin harness")."""

    VERSION = "2023-06-01"

    def __init__(self, *, model: str, max_tokens: int, timeout_s: float, base_url: str | None, api_key: str | None):
        self.url = (base_url or "https://api.anthropic.com").rstrip("/") + "/v1/messages"
        self.api_key, self.timeout_s = api_key or "", timeout_s
        self.model, self.max_tokens = model, max_tokens

    def complete(self, system, history, tools, headers) -> Reply:
        import http.client
        import urllib.error
        import urllib.request

        body = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "system": system,
            "messages": self.render(history),
            "tools": [{"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in tools],
        }
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "content-type": "application/json",
                "x-api-key": self.api_key,
                "anthropic-version": self.VERSION,
                **dict(headers),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                message = json.loads(response.read())
        except urllib.error.HTTPError as err:
            try:
                detail = _error_message(err.read())
            except (OSError, http.client.HTTPException) as unread:  # the error's own body did not arrive
                detail = f"(its body could not be read: {unread})"
            raise _status_error(err.code, detail) from err
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:  # timeouts included
            raise TransientError(f"connection failed: {err}") from err
        except ValueError as err:
            raise TransientError(f"the reply is not JSON: {err}") from err
        try:
            return self._reply(message)
        except (AttributeError, KeyError, TypeError) as err:
            raise ModelCallError(f"the reply is not a Messages API message: {err!r}") from err

    @staticmethod
    def _reply(message: dict) -> Reply:
        blocks = [{k: v for k, v in block.items() if v is not None} for block in message.get("content") or []]
        usage = message.get("usage") or {}
        cached = (usage.get("cache_read_input_tokens") or 0) + (usage.get("cache_creation_input_tokens") or 0)
        return Reply(
            text="".join(b["text"] for b in blocks if b["type"] == "text"),
            tool_calls=tuple(ToolCall(b["id"], b["name"], b.get("input")) for b in blocks if b["type"] == "tool_use"),
            raw={"role": "assistant", "content": blocks or [{"type": "text", "text": "(empty)"}]},
            input_tokens=(usage.get("input_tokens") or 0) + cached,
            output_tokens=usage.get("output_tokens") or 0,
            stop_reason=str(message.get("stop_reason")),
        )


def _error_message(body: bytes) -> str:
    """An API error body's message (`{"error": {"message"}}`), else its text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]


class OpenAIChatBackend(Backend):
    def __init__(self, *, model: str, max_tokens: int, timeout_s: float, base_url: str | None, api_key: str | None):
        openai = import_sdk("openai")
        self.sdk = openai
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.model, self.max_tokens = model, max_tokens

    def render(self, system: str, history: list[Turn]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for turn in history:
            if isinstance(turn, Reply):
                messages.append(turn.raw)
            elif isinstance(turn, UserTurn):
                messages.append({"role": "user", "content": turn.text})
            else:
                messages += [{"role": "tool", "tool_call_id": i, "content": r.text} for i, r in turn.results]
        return messages

    def complete(self, system, history, tools, headers) -> Reply:
        schemas = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in tools
        ]
        try:
            completion = self.client.chat.completions.create(
                model=self.model,
                max_tokens=self.max_tokens,
                messages=self.render(system, history),
                tools=schemas,
                extra_headers=dict(headers),
            )
        except self.sdk.APIError as err:
            raise _map_error(self.sdk, err) from err
        choice = completion.choices[0]
        calls = choice.message.tool_calls or []
        raw: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
        if calls:
            raw["tool_calls"] = [call.model_dump(exclude_none=True) for call in calls]
        usage = completion.usage
        return Reply(
            text=choice.message.content or "",
            tool_calls=tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in calls),
            raw=raw,
            input_tokens=usage.prompt_tokens if usage else 0,
            output_tokens=usage.completion_tokens if usage else 0,
            stop_reason=str(choice.finish_reason),
        )

    def synthetic_call(self, call: ToolCall) -> Reply:
        function = {"name": call.name, "arguments": json.dumps(call.arguments)}
        raw = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": function}],
        }
        return Reply(text="", tool_calls=(call,), raw=raw)


@dataclass
class AgentResult:
    status: Literal["answered", "max_turns"]
    text: str
    turns: int
    compactions: int = 0


class Transcript:
    """JSON lines: one object per event, flushed as written (a killed run keeps what happened)."""

    def __init__(self, stream: TextIO | None):
        self.stream = stream

    def write(self, event: str, **fields: Any) -> None:
        if self.stream is not None:
            self.stream.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}, default=str) + "\n")
            self.stream.flush()


@dataclass
class Agent:
    """One agent (main or sub-agent): its own history, tools and role headers."""

    backend: Backend
    toolbox: ToolBox
    config: AgentConfig
    transcript: Transcript
    agent_id: str | None = None  # None: the main agent
    main_system: str = MAIN_SYSTEM  # the main agent's system prompt (a task may bring its own)
    sleep: Callable[[float], None] = time.sleep
    compactions: int = field(default=0, init=False)

    @property
    def is_sub_agent(self) -> bool:
        return self.agent_id is not None

    @property
    def name(self) -> str:
        return self.agent_id or "main"

    @property
    def system(self) -> str:
        return SUB_AGENT_SYSTEM if self.is_sub_agent else self.main_system

    def tools(self) -> list[ToolSchema]:
        schemas = [ToolSchema(t.name, t.description, t.input_schema) for t in self.toolbox.tools.values()]
        if not self.is_sub_agent and self.config.delegation:
            schemas.append(ToolSchema(DELEGATE, "Give a sub-task to a sub-agent; returns its answer.", DELEGATE_SCHEMA))
        return schemas

    def headers(self, summary: bool) -> dict[str, str]:
        role = ("sub-agent" if self.is_sub_agent else "main") + ("-summary" if summary else "")
        return {ROLE_HEADER: role, AGENT_ID_HEADER: self.agent_id} if self.agent_id else {ROLE_HEADER: role}

    def run(self, task: str) -> AgentResult:
        config = self.config
        max_turns = config.sub_agent_max_turns if self.is_sub_agent else config.max_turns
        history: list[Turn] = [UserTurn(task)]
        if config.force_delegation and not self.is_sub_agent:
            call = ToolCall(f"forced_{uuid.uuid4().hex[:12]}", DELEGATE, {"task": task})
            history += [self.backend.synthetic_call(call), ToolResults(((call.id, self.run_tool(call)),))]
        turns = since_compaction = too_long = 0
        last_tokens = 0
        while turns < max_turns:
            forced = not self.is_sub_agent and 0 < config.force_compaction_after <= since_compaction
            near_limit = config.context_limit > 0 and last_tokens >= config.compact_fraction * config.context_limit
            if forced or near_limit:
                history = self.compact(
                    history, task, "forced" if forced else "near the context limit", config.keep_tail
                )
                since_compaction = last_tokens = 0
            try:
                reply = self.call(history, summary=False)
            except PromptTooLongError as err:
                too_long += 1
                if too_long > 2:
                    raise ModelCallError(f"prompt still too long after compacting: {err}") from None
                history = self.compact(history, task, "prompt too long", config.keep_tail if too_long == 1 else 0)
                since_compaction = last_tokens = 0
                continue
            too_long = 0
            turns += 1
            since_compaction += 1
            last_tokens = reply.input_tokens + reply.output_tokens
            history.append(reply)
            self.transcript.write(
                "turn",
                agent=self.name,
                turn=turns,
                text=reply.text,
                tool_calls=[{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls],
                input_tokens=reply.input_tokens,
                output_tokens=reply.output_tokens,
                stop_reason=reply.stop_reason,
            )
            if not reply.tool_calls:
                return AgentResult("answered", reply.text, turns, self.compactions)
            history.append(ToolResults(tuple((c.id, self.run_tool(c)) for c in reply.tool_calls)))
        last_text = next((t.text for t in reversed(history) if isinstance(t, Reply)), "")
        return AgentResult("max_turns", last_text, turns, self.compactions)

    def run_tool(self, call: ToolCall) -> ToolResult:
        if call.name == DELEGATE and not self.is_sub_agent and self.config.delegation:
            result = self.delegate(call.arguments)
        else:
            result = self.toolbox.call(call.name, call.arguments)
        self.transcript.write(
            "tool", agent=self.name, id=call.id, name=call.name, is_error=result.is_error, result=result.text
        )
        return result

    def delegate(self, arguments: str | Mapping[str, Any] | None) -> ToolResult:
        try:  # bad arguments come back as a tool error, like any tool's
            task = parse_arguments(arguments).get("task")
            if not isinstance(task, str) or not task:
                raise ToolError("argument 'task' must be a non-empty string")
        except ToolError as err:
            return ToolResult(f"error: {err}", is_error=True)
        sub = Agent(
            self.backend,
            self.toolbox.without(DELEGATE),
            self.config,
            self.transcript,
            agent_id=f"sub-{uuid.uuid4().hex[:12]}",
            sleep=self.sleep,
        )
        self.transcript.write("delegate", agent=self.name, sub_agent=sub.agent_id, task=task)
        result = sub.run(task)
        self.transcript.write("sub_agent_end", agent=sub.name, status=result.status, turns=result.turns)
        if result.status != "answered":
            return ToolResult(f"the sub-agent stopped after {result.turns} turns: {result.text}", is_error=True)
        return ToolResult(result.text)

    def call(self, history: list[Turn], *, summary: bool) -> Reply:
        """One model call with bounded retries of transient failures."""
        for attempt in range(self.config.max_retries + 1):
            try:
                return self.backend.complete(self.system, history, self.tools(), self.headers(summary))
            except TransientError as err:
                if attempt == self.config.max_retries:
                    raise ModelCallError(f"gave up after {attempt + 1} attempts: {err}") from None
                delay = min(self.config.retry_max_s, self.config.retry_base_s * 2**attempt)
                log.warning("%s: %s; retrying in %.1f s", self.name, err, delay)
                self.transcript.write("retry", agent=self.name, attempt=attempt + 1, error=str(err), delay_s=delay)
                self.sleep(delay)
        raise AssertionError("unreachable")

    def compact(self, history: list[Turn], task: str, reason: str, keep_tail: int) -> list[Turn]:
        """Summarize `history` (a summary request), then restart from the task + summary + the recent tail."""
        asked = [*history, UserTurn(SUMMARY_INSTRUCTION)]
        while True:
            try:
                reply = self.call(asked, summary=True)
                break
            except PromptTooLongError as err:  # drop the oldest exchange (keep the task) and ask again
                if len(asked) <= 2:
                    raise ModelCallError(f"the summary request alone is too long: {err}") from None
                asked = [asked[0], *asked[3:]] if len(asked) > 3 else [asked[0], asked[-1]]
        summary = reply.text
        start, end = summary.find("<summary>"), summary.rfind("</summary>")
        if start >= 0 and end > start:
            summary = summary[start + len("<summary>") : end]
        summary = summary.strip() or "(the model wrote no summary)"
        tail = history[len(history) - 2 * keep_tail :] if keep_tail and len(history) > 2 * keep_tail else []
        if tail and not isinstance(tail[0], Reply):  # keep whole (assistant, tool results) exchanges only
            tail = []
        self.compactions += 1
        self.transcript.write(
            "compaction", agent=self.name, reason=reason, summary=summary, kept_turns=len(tail), dropped=len(history)
        )
        return [UserTurn(f"{task}\n\n{CONTINUATION}{summary}"), *tail]
