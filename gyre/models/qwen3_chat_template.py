"""Qwen3's chat template, written by us: as Jinja (`qwen3_chat_template.jinja`, stored in `tokenizer_config.json`
by `build_qwen3_tokenizer`) and as plain Python (`render_qwen3_chat`), both rendering what Qwen3's own template
renders. Layout (ChatML with Hermes tool calls):

    <|im_start|>system\n{system}[\n\n# Tools ... <tools>\n{tool json}...\n</tools>\n\n...]<|im_end|>\n
    <|im_start|>user\n{text}<|im_end|>\n
    <|im_start|>assistant\n[<think>\n{thinking}\n</think>\n\n]{text}[\n]<tool_call>\n{"name": "{name}",
        "arguments": {args}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<tool_response>...<|im_end|>\n

The rules (Qwen3's template, as shipped by Qwen/Qwen3-8B; read from the copy TRL bundles as
`trl/chat_templates/qwen3.jinja` in the PyPI wheel trl-1.16.0, "Original Qwen3 chat template"; docs/models.md):
- tools: the system turn carries the first system message, a blank line, then "# Tools" with one JSON signature
  per line inside <tools></tools>; without tools a first system message is its own turn. A later system message
  renders as a system turn where it stands.
- `last_query_index`: the index of the last user message whose content is a string and is not wholly a tool
  response (starts with <tool_response> and ends with </tool_response>); the last message's index if none.
- an assistant turn's thinking is `reasoning_content` when that is a string, else the text before `</think>` in
  its content (the content then keeps what follows, leading newlines stripped). A turn after the last query
  renders `<think>\n{thinking stripped of newlines}\n</think>\n\n{content without leading newlines}` when it is
  the last message or its thinking is not empty; every other assistant turn renders its content alone, so the
  thinking of turns before the last query is dropped from the history.
- tool calls follow the content, each `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, separated by a
  newline (and from the content when the content is not empty); string arguments are emitted verbatim, others
  as JSON (`tojson`: `json.dumps(ensure_ascii=False)`). OpenAI's `{"function": {...}}` wrapper is unwrapped.
- consecutive `tool` messages share one user turn, each result inside <tool_response></tool_response>.
- generation prompt `<|im_start|>assistant\n`, followed by `<think>\n\n</think>\n\n` when `enable_thinking` is
  False (not when it is absent).
- non-string `content` renders as "" (an assistant tool-call turn with `content: None`).
Where ours differs, on input Qwen3's template accepts: none; on input it does not, ours raises (no messages, an
unknown role: Qwen3's renders nothing for it) where Qwen3's fails or silently drops.

Contract: `render_qwen3_chat(messages, tools, add_generation_prompt, enable_thinking)` equals
`render_qwen3_chat_jinja(...)`, which renders `QWEN3_CHAT_TEMPLATE` in the environment of
`transformers.apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, `tojson` without HTML
escaping). Tests: tests/unit/test_models_qwen_chat_template.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gyre.models.chat_template import compiled_jinja, tojson

TEMPLATE_PATH = Path(__file__).with_name("qwen3_chat_template.jinja")
QWEN3_CHAT_TEMPLATE: str = TEMPLATE_PATH.read_text(encoding="utf-8")
ROLES = ("system", "user", "assistant", "tool")

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
EMPTY_THINKING = "<think>\n\n</think>\n\n"


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def last_query_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """The index of the last user message that is a real query (a string, not wholly a tool response)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        content = message.get("content")
        is_text = message.get("role") == "user" and isinstance(content, str)
        if is_text and not (content.startswith(TOOL_RESPONSE_OPEN) and content.endswith(TOOL_RESPONSE_CLOSE)):
            return index
    return len(messages) - 1


def split_thinking(message: Mapping[str, Any]) -> tuple[str, str]:
    """(thinking, content) of an assistant message, as Qwen3's template reads them."""
    text = _text(message)
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, text
    if "</think>" in text:
        before, after = text.split("</think>")[0], text.split("</think>")[-1]
        return before.rstrip("\n").split("<think>")[-1].lstrip("\n"), after.lstrip("\n")
    return "", text


def _tool_call_text(call: Mapping[str, Any], index: int) -> str:
    if call.get("function"):
        call = call["function"]
    name, arguments = call.get("name"), call.get("arguments")
    if not isinstance(name, str):
        raise TypeError(f"messages[{index}].tool_calls: name expected str, got {type(name).__name__}")
    if "arguments" not in call:
        raise TypeError(f"messages[{index}].tool_calls: a call to {name!r} has no arguments")
    args = arguments if isinstance(arguments, str) else tojson(arguments)
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + "}\n</tool_call>"


def render_qwen3_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
) -> str:
    """Render `messages` (and `tools`' signatures) as Qwen3's template does; equals `render_qwen3_chat_jinja`."""
    if not messages:
        raise ValueError("the Qwen3 template needs at least one message")
    parts: list[str] = []
    has_system = messages[0].get("role") == "system"
    if has_system and not isinstance(messages[0].get("content"), str):
        raise TypeError(f"messages[0].content: expected str, got {type(messages[0].get('content')).__name__}")
    if tools:
        parts.append("<|im_start|>system\n")
        if has_system:
            parts.append(messages[0]["content"] + "\n\n")
        parts.append(_TOOLS_HEADER)
        parts.extend("\n" + tojson(tool) for tool in tools)
        parts.append(_TOOLS_FOOTER)
    elif has_system:
        parts.append("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")
    query = last_query_index(messages)
    last = len(messages) - 1
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "system":
            if i:
                parts.append("<|im_start|>system\n" + _text(message) + "<|im_end|>\n")
        elif role == "user":
            parts.append("<|im_start|>user\n" + _text(message) + "<|im_end|>\n")
        elif role == "assistant":
            thinking, text = split_thinking(message)
            parts.append("<|im_start|>assistant\n")
            if i > query and (i == last or thinking):
                parts.append("<think>\n" + thinking.strip("\n") + "\n</think>\n\n" + text.lstrip("\n"))
            else:
                parts.append(text)
            for k, call in enumerate(message.get("tool_calls") or []):
                if text or k:
                    parts.append("\n")
                parts.append(_tool_call_text(call, i))
            parts.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                parts.append("<|im_start|>user")
            parts.append("\n<tool_response>\n" + _text(message) + "\n</tool_response>")
            if i == last or messages[i + 1].get("role") != "tool":
                parts.append("<|im_end|>\n")
        else:
            raise ValueError(f"messages[{i}].role: expected one of {ROLES}, got {role!r}")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            parts.append(EMPTY_THINKING)
    return "".join(parts)


def render_qwen3_chat_jinja(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
) -> str:
    """Render with the Jinja `QWEN3_CHAT_TEMPLATE`; `enable_thinking=None` leaves it undefined, as a caller that
    does not pass it (thinking on)."""
    context: dict[str, Any] = {"enable_thinking": enable_thinking} if enable_thinking is not None else {}
    return compiled_jinja(QWEN3_CHAT_TEMPLATE).render(
        messages=list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        **context,
    )
