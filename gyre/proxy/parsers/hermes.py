"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (SGLang `hermes`,
`qwen25`, `qwen`; gyre's tiny model writes them too).

Wire: `<tool_call>` BODY `</tool_call>` anywhere in the content (Qwen's templates put "\\n" inside both tags and
between blocks). BODY is one call object or a JSON array of them (`json_call.parse_json_calls`). When BODY starts
with "{" or "[", a `</tool_call>` inside one of its JSON string literals does not close the block (the first one
outside a string does); otherwise the first one closes it (Qwen's parser). But when the body up to that one does not
parse, or the output ends before it, and a `</tool_call>` was skipped as inside a string, the block closes at the
first skipped one: a stray quote in one call's JSON (`"it"s"`) then costs that call, not every later one. A block
that does not parse, or is unterminated at the end, is returned as text, tags included.

SGLang's `qwen25` detector finds only blocks written with those newlines (`<tool_call>\\n...\\n</tool_call>`) and
`hermes` parses an unterminated last block; both drop a block that does not parse and calls to tools the request
did not offer. Here the three names are one parser: whitespace around BODY is free, nothing is dropped (a bad block
is text, a call to an unknown tool goes to the harness, which answers it with its own error).
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre.proxy.conversation import ToolSpec
from gyre.proxy.parsers.base import ParsedCall, TaggedBlockParser
from gyre.proxy.parsers.json_call import parse_json_calls


class HermesParser(TaggedBlockParser):
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, tools: Sequence[ToolSpec] = (), *, name: str = "hermes"):
        super().__init__(name=name)  # the tools are not needed: arguments are JSON as written

    def parse_body(self, body: str) -> list[ParsedCall] | str:
        return parse_json_calls(body)

    def _start_block(self) -> None:
        self._json_body: bool | None = None  # the body's first non-whitespace character is "{" or "[" (None: unseen)
        self._in_string = False
        self._escaped = False
        self._skipped = -1  # the first closing tag skipped as inside a JSON string (-1: none)

    def _close_at_end(self) -> int | None:
        return self._skipped if self._skipped >= 0 else None

    def _find_close(self) -> int | None:
        """Index of the closing tag, skipping tags inside JSON strings; None if not there yet."""
        buf, close = self._buf, self.close_tag
        i, n = self._scan, len(buf)
        while i < n:
            c = buf[i]
            if self._in_string:
                if self._skipped < 0 and c == close[0]:
                    if buf.startswith(close, i):
                        self._skipped = i
                    elif close.startswith(buf[i:]):
                        break  # maybe a closing tag, cut by the chunking: wait for more (it is remembered)
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                i += 1
                continue
            if c == close[0]:
                if buf.startswith(close, i):
                    self._scan = i
                    if self._skipped >= 0 and isinstance(parse_json_calls(buf[:i]), str):
                        return self._skipped  # the string tracking went wrong before it: close at the first
                    return i
                if close.startswith(buf[i:]):
                    break  # maybe the closing tag, cut by the chunking: wait for more
            if self._json_body is None and not c.isspace():
                self._json_body = c in "{["
            if c == '"' and self._json_body:
                self._in_string = True
            i += 1
        self._scan = i
        return None
