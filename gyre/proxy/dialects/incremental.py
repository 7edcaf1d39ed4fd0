"""Parse only the new messages of a conversation: the previous request's raw messages and their parses, per thread.

Harnesses resend the whole history on every call, each request the previous one plus a few items (docs/harness.md:
the prefix property). Comparing the raw messages with the previous request's finds the unchanged prefix; its parses
are reused and only the rest is parsed. Messages the server took from the previous decoding
(`gyre.proxy.body_reuse`) are the same objects, found by identity; others are compared with `==` on the decoded
JSON (a C-level walk, ~0.15 ms for 1,200 messages).
A message that changed (Claude Code moves `cache_control` to the last block each turn) is parsed again, as is
everything after it. Pure; one cache per conversation thread (`gyre.proxy.sessions`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class MessageCache:
    """Raw messages of a thread's previous request and what each one parsed into (dialect-specific items)."""

    __slots__ = ("body", "parsed", "raw", "tools", "tools_raw")

    def __init__(self) -> None:
        self.body: Any = None  # the previous body's `gyre.proxy.body_reuse.Layout` (every dialect, incremental or not)
        self.raw: list[Any] = []
        self.parsed: list[Any] = []
        self.tools_raw: Any = None  # the previous request's raw `tools` and their parse (tool schemas are checked
        self.tools: Any = None  # once per change, not per call: ~0.3 ms for Claude Code's two dozen tools)

    def parse_tools(self, raw: Any, parse: Callable[[Any], Any]) -> Any:
        """`parse(raw)`, or the previous parse when `raw` equals the previous request's tools."""
        if self.tools is not None and raw == self.tools_raw:
            return self.tools
        tools = parse(raw)
        self.tools_raw, self.tools = raw, tools
        return tools

    def reusable(self, messages: Sequence[Any]) -> int:
        """How many leading messages equal the previous request's (their parses can be reused)."""
        limit = min(len(messages), len(self.raw))
        count = 0
        while count < limit and (messages[count] is self.raw[count] or messages[count] == self.raw[count]):
            count += 1
        return count

    def store(self, messages: Sequence[Any], parsed: list[Any]) -> None:
        """Remember a successfully parsed request (never a failed one: its messages may be half checked)."""
        self.raw = list(messages)
        self.parsed = parsed
