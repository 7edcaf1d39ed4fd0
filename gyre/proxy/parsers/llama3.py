"""Llama 3.x JSON tool calls (SGLang `llama3`): `{"name": ..., "parameters": {...}}`, several joined by ";".

Wire, as Llama 3.1-3.3's templates ask for them: the content starts with a call object (after whitespace), or
`<|python_tag|>` anywhere in the content is followed by call objects:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

A run of calls is call objects (`json_call.parse_json_call`: "parameters" or "arguments") separated by whitespace
and ";". It ends at the first other character: the rest is text (a ";" after a call is dropped), in which a later
`<|python_tag|>` starts another run. A `{` opens an object that ends at its matching `}` (braces inside JSON strings
do not count); an object that is not a call, or is unterminated at the end, is text, and so is what follows it up
to the next tag (the `<|python_tag|>` that opened the run is text too when no call of the run came before it).
Calls after text need the tag: content that starts with anything but a call object or the tag is text up to a tag.

SGLang's detector also reads Python-dict calls (`{'name': ...}`) and, after a bad object, looks for the next
`{"name":`; here a bad object and what follows it are text. Until its object closes, a content that starts with
"{" is held back (it may be a call), so a plain JSON answer streams only once it is complete.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gyre.proxy.conversation import ToolSpec
from gyre.proxy.parsers.base import ContentItem, Rejections, partial_tag_len
from gyre.proxy.parsers.json_call import parse_json_call

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = re.compile(r"[\s;]*")

_START, _TEXT, _BETWEEN, _OBJECT = "start", "text", "between", "object"


class Llama3Parser:
    def __init__(self, tools: Sequence[ToolSpec] = (), *, name: str = "llama3"):
        self.name = name  # the tools are not needed: arguments are JSON as written
        self._rejections = Rejections(name)
        self._mode = _START
        self._buf = ""
        self._opener = ""  # what opened the current run, returned as text if its first object is no call
        self._scan = 0  # object mode: position in the object scanned so far
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str, *, final: bool = False) -> list[ContentItem]:
        self._buf += text
        items: list[ContentItem] = []
        step = {
            _START: self._step_start,
            _TEXT: self._step_text,
            _BETWEEN: self._step_between,
            _OBJECT: self._step_object,
        }
        while step[self._mode](items, final):
            pass
        if final:
            self._rejections.finish()
        return [item for item in items if item != ""]

    def _step_start(self, items: list[ContentItem], final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith("{"):
            self._buf = stripped
            self._open_object("")
        elif stripped.startswith(PYTHON_TAG):
            self._buf = stripped[len(PYTHON_TAG) :]
            self._opener, self._mode = PYTHON_TAG, _BETWEEN
        elif PYTHON_TAG.startswith(stripped) and not final:
            return False  # empty, or maybe the start of the tag
        else:
            self._mode = _TEXT
        return True

    def _step_text(self, items: list[ContentItem], final: bool) -> bool:
        start = self._buf.find(PYTHON_TAG)
        if start >= 0:
            items.append(self._buf[:start])
            self._buf = self._buf[start + len(PYTHON_TAG) :]
            self._opener, self._mode = PYTHON_TAG, _BETWEEN
            return True
        keep = 0 if final else partial_tag_len(self._buf, PYTHON_TAG)
        items.append(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _step_between(self, items: list[ContentItem], final: bool) -> bool:
        """Between calls of a run (or right after the tag): separators, then a call object or the end of the run."""
        skip = _SEPARATORS.match(self._buf).end()
        if self._buf.startswith("{", skip):
            self._buf = self._buf[skip:]
            self._open_object(self._opener)
            return True
        if skip == len(self._buf):
            if not final:
                return False  # only separators so far
            if self._opener:  # a tag and no call at all
                self._rejections.add(f"no call object after {PYTHON_TAG}", self._opener + self._buf)
                items.append(self._opener + self._buf)
            self._buf = ""  # separators after the last call are glue
            return False
        if self._opener:
            self._rejections.add(f"no call object after {PYTHON_TAG}", self._opener + self._buf[: skip + 30])
            items.append(self._opener + self._buf[:skip])
        else:  # after a call its ";" are glue; the whitespace stays between the texts around the calls
            items.append(self._buf[:skip].replace(";", ""))
        self._buf = self._buf[skip:]
        self._opener, self._mode = "", _TEXT
        return True

    def _open_object(self, opener: str) -> None:
        self._opener, self._mode = opener, _OBJECT
        self._scan, self._depth, self._in_string, self._escaped = 0, 0, False, False

    def _step_object(self, items: list[ContentItem], final: bool) -> bool:
        end = self._find_object_end()
        if end is None:
            if final:
                raw = self._opener + self._buf
                self._rejections.add("a call object unterminated at the end of the output", raw)
                items.append(raw)
                self._buf = ""
            return False
        obj, self._buf = self._buf[:end], self._buf[end:]
        call = parse_json_call(obj)
        if isinstance(call, str):
            self._rejections.add(call, self._opener + obj)
            items.append(self._opener + obj)
            self._opener, self._mode = "", _TEXT
        else:
            items.append(call)
            self._opener, self._mode = "", _BETWEEN
        return True

    def _find_object_end(self) -> int | None:
        """Index after the `}` matching the object's `{` (braces in JSON strings skipped); None if not there yet."""
        buf, i, n = self._buf, self._scan, len(self._buf)
        while i < n:
            c = buf[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "{":
                self._depth += 1
            elif c == "}":
                self._depth -= 1
                if self._depth == 0:
                    self._scan = i
                    return i
        self._scan = i
        return None
