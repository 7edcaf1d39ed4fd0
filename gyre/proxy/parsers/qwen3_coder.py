"""Qwen3-Coder tool calls: XML-like function and parameter tags (SGLang `qwen3_coder`).

Wire, as Qwen3-Coder's chat template renders a call:

    <tool_call>
    <function=read_file>
    <parameter=path>
    src/main.py
    </parameter>
    <parameter=limit>
    40
    </parameter>
    </function>
    </tool_call>

`<tool_call>` BODY `</tool_call>` anywhere in the content; the first `</tool_call>` closes the block (parameter
values are raw text, not quoted). BODY is one or more `<function=NAME>` ... `</function>` (the last may lack its
`</function>`), separated by whitespace; a function holds `<parameter=P>VALUE</parameter>` items separated by
whitespace. A value ends at the first `</parameter>`, `<parameter=` or `</function>` after it, whichever comes first
(as SGLang reads it): so a value missing its `</parameter>` ends at the next tag, and a value that contains
`<parameter=` or `</function>` as text is cut there (the model cannot write those inside a value). One "\\n" at each
end of a value is template glue and removed; the rest is kept verbatim.

Values are typed by the request's tool schema, as SGLang's detector does (the schema's `properties`, descending
into anyOf/oneOf/allOf; a parameter's type from `type`, a type list's first non-null, anyOf/oneOf, enum values,
allOf): string types keep the text; integer types become an int and number types a float (an int when written
without "." or "e") when they parse; boolean becomes true/false when the text is that word in any case; object and
array types take the text as JSON when it parses; `null` in any case is null for every non-string type. A value
that does not convert, a parameter the schema does not declare, or a tool the request did not offer keeps the text
(SGLang turns a non-boolean word into false and tries Python literals; here it stays the model's text).
The call's arguments are `json.dumps` of the parameters in the model's order (duplicates: the last wins).

A body that breaks the grammar (text outside the tags, no function, an unclosed `<function=`/`<parameter=` name) or
a block unterminated at the end is returned as text, tags included.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gyre.proxy.conversation import ToolSpec
from gyre.proxy.parsers.base import ParsedCall, TaggedBlockParser
from gyre.proxy.parsers.json_call import strict_json

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
_WS = re.compile(r"\s*")
_NAME = re.compile(r"[^<>\n]+")  # a function or parameter name: up to ">", on one line, no tags

_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_JSON_TYPES = ("object", "array", "arr", "dict", "list")


# ----------------------------------------------------------------------------- schema types


def schema_properties(schema: Any) -> dict[str, Any]:
    """Top-level `properties` of a parameters schema, merged from anyOf/oneOf/allOf branches when it has none."""
    if not isinstance(schema, Mapping):
        return {}
    properties = schema.get("properties")
    if isinstance(properties, Mapping):
        return dict(properties)
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            for branch in branches:
                for key, value in schema_properties(branch).items():
                    merged.setdefault(key, value)
    return merged


def _enum_type(values: list[Any]) -> str:
    kinds = set()
    for value in values:
        if value is None:
            kinds.add("null")
        elif isinstance(value, bool):
            kinds.add("boolean")
        elif isinstance(value, int):
            kinds.add("integer")
        elif isinstance(value, float):
            kinds.add("number")
        elif isinstance(value, list):
            kinds.add("array")
        elif isinstance(value, Mapping):
            kinds.add("object")
        else:
            kinds.add("string")
    return kinds.pop() if len(kinds) == 1 else "string"


def schema_type(schema: Any, depth: int = 0) -> str | None:
    """The primary JSON type of a parameter's schema (lower case), or None when the schema says none."""
    if not isinstance(schema, Mapping) or depth > 32:
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared.strip().lower()
    if isinstance(declared, list) and declared:
        non_null = [t for t in declared if t != "null"]
        return str(non_null[0]).strip().lower() if non_null else "string"
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        types = [t for t in (schema_type(branch, depth + 1) for branch in branches) if t]
        distinct = set(types)
        if len(distinct) == 1:
            return types[0]
        if len(distinct) == 2 and "null" in distinct:
            return next(t for t in types if t != "null")
        if types:
            return "string" if "string" in distinct else types[0]
    if isinstance(schema.get("enum"), list):
        return _enum_type(schema["enum"]) if schema["enum"] else "string"
    if isinstance(schema.get("allOf"), list):
        for branch in schema["allOf"]:
            kind = schema_type(branch, depth + 1)
            if kind and kind != "string":
                return kind
        return "string"
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def convert_value(text: str, kind: str | None) -> Any:
    """A parameter's text typed as `kind` (module docstring); the text itself when it does not convert."""
    if kind is None or kind in _STRING_TYPES:
        return text
    if text.lower() == "null":
        return None
    try:
        if kind.startswith(_INT_PREFIXES):
            return int(text)
        if kind.startswith(("num", "float")):
            number = float(text)
            if not math.isfinite(number):
                return text
            return int(number) if number.is_integer() and not any(c in text.lower() for c in ".e") else number
        if kind in ("boolean", "bool", "binary"):
            return {"true": True, "false": False}.get(text.strip().lower(), text)
        if kind.startswith(_JSON_TYPES):
            return strict_json(text)
    except (ValueError, RecursionError):  # int("x"), float("x"), bad JSON, absurd nesting
        return text
    return text


# ----------------------------------------------------------------------------- body grammar


def _tag_name(body: str, i: int, prefix: str) -> tuple[str, int] | str:
    """The name of the tag `prefix NAME >` at `i`, and the index after ">", or why there is none."""
    start = i + len(prefix)
    match = _NAME.match(body, start)
    if match is None or not body.startswith(">", match.end()) or not match.group().strip():
        return f"{prefix}... without a name closed by '>'"
    return match.group().strip(), match.end() + 1


class _NextTag:
    """Where each tag next occurs at or after a position, for positions that only grow (one left-to-right read of
    a body): each tag is searched for once per occurrence, so a body is read in linear time however many of its
    values lack their `</parameter>`."""

    def __init__(self, body: str):
        self.body = body
        self._at: dict[str, int] = {}  # tag -> its first occurrence at or after the last start asked; -1: none

    def __call__(self, tag: str, start: int) -> int:
        at = self._at.get(tag)
        if at is None or 0 <= at < start:
            at = self._at[tag] = self.body.find(tag, start)
        return at


def _parameter_end(body: str, start: int, next_tag: _NextTag) -> tuple[int, int]:
    """(end of the value starting at `start`, index after its closing tag): the first of `</parameter>`, the next
    `<parameter=` or `</function>`, else the end of the body (SGLang's qwen3_coder cuts a value at each of them)."""
    end, after = len(body), len(body)
    for tag in (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE):
        at = next_tag(tag, start)
        if 0 <= at < end:
            end, after = at, at + (len(tag) if tag == PARAMETER_CLOSE else 0)
    return end, after


def _function(body: str, i: int, next_tag: _NextTag) -> tuple[str, dict[str, str], int] | str:
    """The function at `i` (which starts with `<function=`): (name, raw parameters, index after it) or a reason."""
    named = _tag_name(body, i, FUNCTION_OPEN)
    if isinstance(named, str):
        return named
    name, i = named
    parameters: dict[str, str] = {}
    while True:
        i = _WS.match(body, i).end()
        if body.startswith(FUNCTION_CLOSE, i):
            return name, parameters, i + len(FUNCTION_CLOSE)
        if i == len(body) or body.startswith(FUNCTION_OPEN, i):
            return name, parameters, i  # a function without its </function>
        if not body.startswith(PARAMETER_OPEN, i):
            return f"unexpected text in function {name!r}: {body[i : i + 30]!r}"
        named = _tag_name(body, i, PARAMETER_OPEN)
        if isinstance(named, str):
            return named
        parameter, start = named
        end, i = _parameter_end(body, start, next_tag)
        value = body[start:end]
        value = value[1:] if value.startswith("\n") else value
        parameters[parameter] = value[:-1] if value.endswith("\n") else value


def parse_functions(body: str) -> list[tuple[str, dict[str, str]]] | str:
    """The functions of a block's body as (name, raw parameter texts), or why it is not a call."""
    functions: list[tuple[str, dict[str, str]]] = []
    next_tag = _NextTag(body)
    i = _WS.match(body).end()
    while i < len(body):
        if not body.startswith(FUNCTION_OPEN, i):
            return f"expected {FUNCTION_OPEN}NAME>, got {body[i : i + 30]!r}"
        parsed = _function(body, i, next_tag)
        if isinstance(parsed, str):
            return parsed
        name, parameters, i = parsed
        functions.append((name, parameters))
        i = _WS.match(body, i).end()
    return functions or f"no {FUNCTION_OPEN}NAME> in the block"


class Qwen3CoderParser(TaggedBlockParser):
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, tools: Sequence[ToolSpec] = (), *, name: str = "qwen3_coder"):
        super().__init__(name=name)
        # tool name -> parameter name -> its type (None: untyped); a tool not offered types nothing
        self._types: dict[str, dict[str, str | None]] = {}
        for tool in tools:
            properties = schema_properties(tool.parameters)
            self._types[tool.name] = {key: schema_type(value) for key, value in properties.items()}

    def parse_body(self, body: str) -> list[ParsedCall] | str:
        functions = parse_functions(body)
        if isinstance(functions, str):
            return functions
        calls = []
        for name, raw in functions:
            types = self._types.get(name, {})
            arguments = {key: convert_value(text, types.get(key)) for key, text in raw.items()}
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
        return calls
