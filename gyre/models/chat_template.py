"""The chat template of gyre's tiny model, as Jinja and as plain Python.

Layout is Qwen2.5/Hermes ChatML, so the tiny model sees the same wire as a real Qwen checkpoint:

    <|im_start|>system\n{system}<|im_end|>\n
    <|im_start|>user\n{text}<|im_end|>\n
    <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n{text}
        \n<tool_call>\n{"name": "{name}", "arguments": {json}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response>
        \n<tool_response>\n{result}\n</tool_response><|im_end|>\n

Consecutive `tool` messages share one user turn. With `tools`, the system turn lists their JSON signatures.
No default system prompt is injected: every token counts for a tiny model.

Contract: `render_chat(messages, tools, add_generation_prompt)` returns exactly the string that
`CHAT_TEMPLATE` renders under the environment `transformers.apply_chat_template` uses (sandboxed Jinja,
`trim_blocks`, `lstrip_blocks`, `tojson` = `json.dumps(ensure_ascii=False)`); `render_chat_jinja` renders
that template here for tests and tools. Messages are dicts with `role` in system/user/assistant/tool and a
string `content`; an assistant message may carry `tool_calls` (`{"name", "arguments"}` or OpenAI's
`{"function": {...}}`; `arguments` a dict, or a string emitted verbatim) and `reasoning_content`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
CHAT_TEMPLATE: str = TEMPLATE_PATH.read_text(encoding="utf-8")

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


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    """transformers' `tojson` filter (jinja2's own escapes <, >, & and ' as \\u003c...)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _text(message: Mapping[str, Any], key: str, index: int) -> str:
    value = message.get(key)
    if not isinstance(value, str):
        raise TypeError(f"messages[{index}].{key}: expected str, got {type(value).__name__}")
    return value


def _tool_call_text(call: Mapping[str, Any]) -> str:
    if "function" in call:
        call = call["function"]
    name, arguments = call.get("name"), call.get("arguments")
    if not isinstance(name, str):
        raise TypeError(f"tool call name: expected str, got {type(name).__name__}")
    args = arguments if isinstance(arguments, str) else tojson(arguments)
    return '\n<tool_call>\n{"name": "' + name + '", "arguments": ' + args + "}\n</tool_call>"


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render `messages` (and `tools`' signatures) to the prompt string; equals `render_chat_jinja`."""
    parts: list[str] = []
    first_is_system = bool(messages) and messages[0].get("role") == "system"
    if tools:
        parts.append("<|im_start|>system\n")
        if first_is_system:
            parts.append(_text(messages[0], "content", 0) + "\n\n")
        parts.append(_TOOLS_HEADER)
        parts.extend("\n" + tojson(dict(tool)) for tool in tools)
        parts.append(_TOOLS_FOOTER)
    elif first_is_system:
        parts.append("<|im_start|>system\n" + _text(messages[0], "content", 0) + "<|im_end|>\n")
    last = len(messages) - 1
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "system":
            if i != 0:
                raise ValueError(f"messages[{i}].role: a system message may only come first")
        elif role == "user" or (
            role == "assistant" and not message.get("tool_calls") and not message.get("reasoning_content")
        ):
            parts.append(f"<|im_start|>{role}\n" + _text(message, "content", i) + "<|im_end|>\n")
        elif role == "assistant":
            parts.append("<|im_start|>assistant")
            if message.get("reasoning_content"):
                parts.append("\n<think>\n" + _text(message, "reasoning_content", i) + "\n</think>")
            if message.get("content"):
                parts.append("\n" + _text(message, "content", i))
            parts.extend(_tool_call_text(call) for call in message.get("tool_calls") or [])
            parts.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                parts.append("<|im_start|>user")
            parts.append("\n<tool_response>\n" + _text(message, "content", i) + "\n</tool_response>")
            if i == last or messages[i + 1].get("role") != "tool":
                parts.append("<|im_end|>\n")
        else:
            raise ValueError(f"messages[{i}].role: expected one of {ROLES}, got {role!r}")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


@cache
def compiled_jinja(template: str) -> Any:
    """`template` compiled in the environment `transformers.apply_chat_template` builds (needs jinja2)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat_jinja(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render with the Jinja `CHAT_TEMPLATE` (needs `jinja2`); the reference `render_chat` is tested against."""
    return compiled_jinja(CHAT_TEMPLATE).render(
        messages=list(messages), tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt
    )
