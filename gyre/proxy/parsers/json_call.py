"""A tool call written as one JSON object, `{"name": ..., "arguments": {...}}` (Hermes, Qwen2.5/3, Llama 3).

`parse_json_call(text)`: `text` (surrounding whitespace allowed) must be exactly one JSON object with a non-empty
string "name" and "arguments" that is an object, or a string holding a JSON object; "parameters" (Llama 3's key) is
read when "arguments" is missing, and neither means no arguments ("{}"). The call's arguments are the exact text of
that object as the model wrote it (sliced, so an echo of it compares equal byte for byte), or the inner string
(stripped) in the string form. JSON is strict (no NaN/Infinity, no raw control characters in strings, as
`json.loads` in vLLM's Hermes parser). The result is a `ParsedCall`, or the reason the text is not a call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gyre.proxy.parsers.base import ParsedCall

_JSON_WS = re.compile(r"[ \t\n\r]*")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def strict_json(text: str) -> Any:
    """`json.loads` without NaN/Infinity; raises ValueError (or RecursionError for absurd nesting)."""
    return json.loads(text, parse_constant=_reject_constant)


def _object_members(text: str) -> dict[str, tuple[Any, int, int]] | None:
    """The members of the JSON object `text` (exactly one object) as key -> (value, start, end); None if invalid."""
    if not text.startswith("{"):
        return None
    members: dict[str, tuple[Any, int, int]] = {}
    try:
        i = _JSON_WS.match(text, 1).end()
        if text.startswith("}", i):
            return members if i + 1 == len(text) else None
        while True:
            if not text.startswith('"', i):
                return None
            key, i = _DECODER.raw_decode(text, i)
            i = _JSON_WS.match(text, i).end()
            if not text.startswith(":", i):
                return None
            start = _JSON_WS.match(text, i + 1).end()
            value, end = _DECODER.raw_decode(text, start)
            members[key] = (value, start, end)
            i = _JSON_WS.match(text, end).end()
            if text.startswith(",", i):
                i = _JSON_WS.match(text, i + 1).end()
            elif text.startswith("}", i):
                return members if i + 1 == len(text) else None
            else:
                return None
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; absurd nesting recurses
        return None


def parse_json_call(text: str) -> ParsedCall | str:
    """The call written as the JSON object `text`, or why it is not one (module docstring)."""
    text = text.strip()
    members = _object_members(text)
    if members is None:
        return "not one JSON object"
    name = members["name"][0] if "name" in members else None
    if not isinstance(name, str) or not name:
        return 'no non-empty string "name"'
    key = "arguments" if "arguments" in members else "parameters"
    if key not in members:
        return ParsedCall(name, "{}")
    value, start, end = members[key]
    if isinstance(value, dict):
        return ParsedCall(name, text[start:end])
    if isinstance(value, str):
        inner = value.strip()
        try:
            decoded = strict_json(inner)
        except (ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, dict):
            return ParsedCall(name, inner)
    return f'"{key}" is neither a JSON object nor a string holding one'


def parse_json_calls(text: str) -> list[ParsedCall] | str:
    """One call object, or a JSON array of one or more call objects (Hermes allows both); all must be calls."""
    text = text.strip()
    if not text.startswith("["):
        call = parse_json_call(text)
        return call if isinstance(call, str) else [call]
    calls: list[ParsedCall] = []
    try:
        i = _JSON_WS.match(text, 1).end()
        while True:
            _, end = _DECODER.raw_decode(text, i)
            call = parse_json_call(text[i:end])
            if isinstance(call, str):
                return f"array element {len(calls)}: {call}"
            calls.append(call)
            i = _JSON_WS.match(text, end).end()
            if text.startswith(",", i):
                i = _JSON_WS.match(text, i + 1).end()
            elif text.startswith("]", i) and i + 1 == len(text):
                return calls
            else:
                return "not one JSON array of call objects"
    except (ValueError, RecursionError):
        return "not one JSON array of call objects"
