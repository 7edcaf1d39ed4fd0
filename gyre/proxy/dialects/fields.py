"""The field checks all three dialects read a request body with: one set of checks, one message shape.

Contract (pure): a check takes a decoded JSON value and its field's path, returns the value (typed) or raises
`ApiError("invalid_request", message, param=path)`, which the server answers with the dialect's `error_body` and
status 400. Every message names the field's path, what it got (the JSON type of a value of the wrong type, the value
itself when its type is right but the value is not) and what is allowed:

    Anthropic   messages.3.content: expected an array, got integer       max_tokens: must be >= 1, got 0
    OpenAI      messages[3].content must be an array, got integer        max_tokens: must be at least 1, got 0

A dialect holds one `FieldChecks` built with its `Spelling`: the few words in which its messages differ from the
other dialects' (how a wrong type or choice is phrased, how a lower bound reads), kept as its clients and tests know
them. Every other word is this module's, the same in all dialects. Paths are the dialect's own
(`messages.3.content` in Anthropic's, `messages[3].content` in OpenAI's).

Also here: the header readers the dialects take their role signals with (`header_signals`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gyre.config.checks import is_int, is_number
from gyre.proxy.conversation import ApiError, compact_json

_JSON_TYPES: dict[type, str] = {
    type(None): "null",
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def json_type(value: Any) -> str:
    """The JSON type name of a decoded value ("null", "boolean", "integer", "number", "string", "array", "object")."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def decode_body(raw: bytes, max_depth: int) -> Any:
    """A request body decoded (orjson), or the 400 for one that is not JSON or nests containers more than
    `max_depth` levels deep (docs/proxy.md, "One call")."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise ApiError("invalid_request", f"the request body is not valid JSON (UTF-8): {error}") from None
    if nesting_depth_exceeds(body, max_depth):
        raise ApiError(
            "invalid_request",
            f"the request body nests objects and arrays more than {max_depth} levels deep "
            f"(at most {max_depth} are accepted)",
        )
    return body


def nesting_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether decoded JSON `value` nests containers (objects, arrays) more than `limit` levels deep (a top-level
    container is level 1). Level by level, without recursion: a hostile body cannot exhaust the interpreter's stack
    here; each container is visited once and strings and numbers, the bulk of a long history, cost a type check.
    Decoded JSON holds plain dicts and lists only (`type(x) is dict` is the fast test)."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 1
    while level:
        if depth > limit:
            return True
        below: list[Any] = []
        push = below.append
        for item in level:
            for child in item.values() if type(item) is dict else item:
                if type(child) is dict or type(child) is list:
                    push(child)
        level = below
        depth += 1
    return False


@dataclass(frozen=True)
class Spelling:
    """The words of one dialect's field messages that differ from the other dialects'.

    Templates: `expected` gets `path`, `allowed` and `got`; `choices` gets the allowed values written as
    "'a', 'b' or 'c'"; `at_least` gets `low`.
    """

    expected: str  # a value of the wrong type or not one of the choices
    choices: str  # "{}" ("expected 'a' or 'b'") or "one of {}" ("must be one of 'a' or 'b'")
    at_least: str  # a lower bound: ">= {low}" or "at least {low}"


class FieldChecks:
    """The checks, spelled the way of one dialect (`Spelling`); each raises `ApiError` naming the field's path."""

    def __init__(self, spelling: Spelling):
        self.spelling = spelling

    # ------------------------------------------------------------------ errors

    def invalid(self, path: str, problem: str) -> ApiError:
        """The error for a field whose value breaks a rule: "<path>: <problem>"."""
        return ApiError("invalid_request", f"{path}: {problem}", param=path)

    def expected(self, path: str, allowed: str, got: str) -> ApiError:
        """The error for a field of the wrong type (`got` its JSON type) or not one of the choices (`got` its value)."""
        message = self.spelling.expected.format(path=path, allowed=allowed, got=got)
        return ApiError("invalid_request", message, param=path)

    def wrong_type(self, path: str, allowed: str, value: Any) -> ApiError:
        return self.expected(path, allowed, json_type(value))

    def unsupported_input(self, path: str, what: str) -> ApiError:
        """A content part the model cannot take ("image", "audio", "file"): the supported models are text-only."""
        return self.invalid(path, f"{what} input is not supported by this model")

    # ------------------------------------------------------------------ checks

    def text(self, value: str, path: str) -> str:
        """`value` if it can be encoded as UTF-8 (a JSON `\\ud800` escape decodes to a lone surrogate that cannot:
        tokenizers and the recorder could not encode it)."""
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise self.invalid(path, "string is not valid Unicode (a lone surrogate)") from None
        return value

    def string(self, value: Any, path: str, *, non_empty: bool = False) -> str:
        if not isinstance(value, str):
            raise self.wrong_type(path, "a string", value)
        if non_empty and not value:
            raise self.invalid(path, "must be a non-empty string")
        return self.text(value, path)

    def optional_string(self, value: Any, path: str) -> str | None:
        return None if value is None else self.string(value, path)

    def object(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.wrong_type(path, "an object", value)
        return value

    def optional_object(self, value: Any, path: str) -> dict[str, Any] | None:
        return None if value is None else self.object(value, path)

    def array(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.wrong_type(path, "an array", value)
        return value

    def optional_bool(self, value: Any, path: str) -> bool | None:
        if value is not None and not isinstance(value, bool):
            raise self.wrong_type(path, "a boolean", value)
        return value

    def optional_number(self, value: Any, path: str, *, low: float, high: float) -> float | None:
        """A finite number in [low, high] as a float, or None when absent."""
        if value is None:
            return None
        if not is_number(value):
            raise self.wrong_type(path, "a number", value)
        if not (math.isfinite(value) and low <= value <= high):
            raise self.invalid(path, f"must be between {low} and {high}, got {value!r}")
        return float(value)

    def optional_int(self, value: Any, path: str, *, low: int | None = None) -> int | None:
        """An integer (not a boolean), at least `low` when given, or None when absent."""
        if value is None:
            return None
        if not is_int(value):
            raise self.wrong_type(path, "an integer", value)
        if low is not None and value < low:
            raise self.invalid(path, f"must be {self.spelling.at_least.format(low=low)}, got {value}")
        return value

    def choice(self, value: Any, path: str, allowed: Sequence[str], *, where: str = "") -> Any:
        """`value` if it is one of `allowed`; `where` ("in a user message") says where that list applies."""
        if value in allowed:
            return value
        quoted = [repr(item) for item in allowed]
        listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        phrase = self.spelling.choices.format(listed) + (f" {where}" if where else "")
        raise self.expected(path, phrase, repr(value))

    def json_text(self, value: Any, path: str) -> str:
        """`compact_json(value)`, refusing what is not strict JSON (NaN, infinities) or cannot be encoded."""
        try:
            json.dumps(value, allow_nan=False)
            text = compact_json(value)
            text.encode("utf-8")
        except ValueError:  # NaN / Infinity (UnicodeEncodeError is a ValueError too)
            raise self.invalid(path, "must be strict JSON: no NaN, Infinity or lone surrogates") from None
        except RecursionError:
            raise self.invalid(path, "is nested too deeply") from None
        return text


# ----------------------------------------------------------------------------- headers


def lower_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers with lower-cased names (HTTP header names are case-insensitive)."""
    return {str(key).lower(): value for key, value in headers.items()}


def header_signals(headers: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    """The headers of `headers` named in `names` (lower-case), under their lower-case names: a call's signals."""
    lowered = lower_headers(headers)
    return {name: lowered[name] for name in names if name in lowered}
