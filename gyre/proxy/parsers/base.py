"""The two parser contracts `gyre.proxy.output.OutputParser` chains, and the tagged-block machine two dialects share.

A `ReasoningParser` splits the output text into thinking (`ThinkingDelta`s, final: template glue already removed)
and content (raw `str` pieces); the content goes through a `ToolCallParser`, which splits it into answer text (raw
`str` pieces: `OutputParser` strips the whitespace at its ends) and `ParsedCall`s. Both are incremental and share
one contract:
- `feed(text, final=False)` any number of times, then `feed("", final=True)` once (the end of the output; `text`
  may be non-empty there too). Each returns the items it completed, in output order.
- For any chunking of a text, the items (adjacent pieces of one kind joined) equal those of feeding the whole text
  at once: a parser decides only on what it has seen, and holds back a suffix that may still change its meaning
  (the start of a tag, an unfinished call) until it can tell.
- Never raises on model output: whatever cannot be parsed is content / text, its tags included. A tool call
  returned as text is logged as a warning naming the parser and the reason, the first of an output only, the
  others counted (`Rejections`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

from gyre.proxy.conversation import ThinkingDelta

log = logging.getLogger(__name__)

EXCERPT_CHARS = 160  # of a rejected call's raw text in the warning


class ParsedCall(NamedTuple):
    """A tool call as parsed, before the proxy gives it an id (`gyre.proxy.conversation.ToolCall`)."""

    name: str
    arguments: str  # the text of one JSON object


ContentItem = str | ParsedCall  # answer text (raw) or a call
ReasoningItem = ThinkingDelta | str  # thinking (final) or content (raw)


class ReasoningParser(Protocol):
    def feed(self, text: str, *, final: bool = False) -> list[ReasoningItem]: ...


class ToolCallParser(Protocol):
    def feed(self, text: str, *, final: bool = False) -> list[ContentItem]: ...


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _excerpt(text: str) -> str:
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 40] + " ... " + text[-35:]


class Rejections:
    """The warnings of one output's tool calls returned as text: the first is logged with its reason and an excerpt
    (both cut to `EXCERPT_CHARS`), the others are counted and logged as one line at the output's end, so a model
    writing thousands of malformed blocks costs two log lines."""

    def __init__(self, parser: str):
        self.parser = parser
        self.count = 0

    def add(self, reason: str, raw: str) -> None:
        self.count += 1
        if self.count == 1:
            log.warning(
                "tool_call_parser=%s: a tool call is returned as text (%s): %r",
                self.parser,
                _excerpt(reason),
                _excerpt(raw),
            )

    def finish(self) -> None:
        if self.count > 1:
            log.warning(
                "tool_call_parser=%s: %d more tool calls of this output returned as text", self.parser, self.count - 1
            )
        self.count = 0


class TaggedBlockParser:
    """Tool calls as `open_tag BODY close_tag` blocks anywhere in the content; everything else is text.

    A subclass names its tags and implements `parse_body` (the calls of one body, or the reason it is not one);
    it may override `_find_close` (by default the first `close_tag` after the open tag closes the block). A body
    that does not parse, or a block unterminated at the end, is returned as text, tags included.
    """

    open_tag: str
    close_tag: str

    def __init__(self, *, name: str):
        self.name = name
        self._rejections = Rejections(name)
        self._buf = ""  # content not yet consumed: text, or the body of an open block
        self._in_block = False
        self._scan = 0  # position in the block's body up to which `_find_close` has looked

    def parse_body(self, body: str) -> list[ParsedCall] | str:
        raise NotImplementedError

    def feed(self, text: str, *, final: bool = False) -> list[ContentItem]:
        self._buf += text
        items: list[ContentItem] = []
        while self._step(items, final):
            pass
        if final:
            self._rejections.finish()
        return [item for item in items if item != ""]

    def _step(self, items: list[ContentItem], final: bool) -> bool:
        if not self._in_block:
            start = self._buf.find(self.open_tag)
            if start >= 0:
                items.append(self._buf[:start])
                self._buf = self._buf[start + len(self.open_tag) :]
                self._in_block, self._scan = True, 0
                self._start_block()
                return True
            keep = 0 if final else partial_tag_len(self._buf, self.open_tag)
            items.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        end = self._find_close()
        if end is None and final:
            end = self._close_at_end()
        if end is None:
            if final:
                raw = self.open_tag + self._buf
                self._rejections.add(f"no {self.close_tag} before the end of the output", raw)
                items.append(raw)
                self._buf, self._in_block = "", False
            return False
        body = self._buf[:end]
        self._buf = self._buf[end + len(self.close_tag) :]
        self._in_block = False
        parsed = self.parse_body(body)
        if isinstance(parsed, str):
            raw = self.open_tag + body + self.close_tag
            self._rejections.add(parsed, raw)
            items.append(raw)
        else:
            items.extend(parsed)
        return True

    def _start_block(self) -> None:
        """Reset a subclass's per-block scan state (called at each open tag)."""

    def _close_at_end(self) -> int | None:
        """Where the block closes when the output ended before `_find_close` found its closing tag (None: nowhere,
        the block is unterminated)."""
        return None

    def _find_close(self) -> int | None:
        """Index in the body buffer of the closing tag; None if it has not arrived yet."""
        end = self._buf.find(self.close_tag, self._scan)
        if end >= 0:
            return end
        self._scan = max(0, len(self._buf) - len(self.close_tag) + 1)  # a closing tag may still end here
        return None
