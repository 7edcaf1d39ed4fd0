"""Output token ids -> text, thinking and tool calls, incrementally (streaming) or at once, with identical results.

Role: the proxy feeds the engine's output ids into an `OutputDecoder` (a `Detokenizer` then an `OutputParser`) and
hands the `OutputEvent`s to a dialect's stream writer, or the final `AssistantOutput` to its JSON writer. Pure: no IO
(a tool call returned as text is logged as a warning).

Contract:
- `Detokenizer`: `"".join(feed(...) pieces) + flush() == tokenizer.decode(ids without skip_ids,
  skip_special_tokens=False)` for byte-level tokenizers; `feed` never returns a partial character.
- `OutputParser`: for any chunking of a text, the events of `feed(...)* + finish()` equal (after merging adjacent
  deltas of one kind) the events of feeding the whole text at once, and the `AssistantOutput` is their merge:
  `text` = the TextDeltas joined, `thinking` = the ThinkingDeltas joined, `tool_calls` = the ToolCallDones.
  It never raises on model output: whatever cannot be parsed is returned as text.

Output grammar: the model's dialect, chosen by name (`gyre.proxy.parsers.registry`, SGLang's names): a reasoning
parser (`proxy.reasoning_parser`: qwen3 `<think>...</think>` by default, `gyre.proxy.parsers.reasoning`) splits
thinking from content, and a tool-call parser (`proxy.tool_call_parser`: hermes `<tool_call>{json}</tool_call>` by
default, qwen3_coder, llama3; one module each in `gyre.proxy.parsers`) splits the content into text and calls.
Both follow the contract above on their own (`gyre.proxy.parsers.base`), so their chain does too.
Final text is stripped of leading and trailing whitespace (`str.strip`), so whitespace around tool calls (their
"\\n" glue) and after `</think>` vanishes; whitespace between two pieces of text is kept, even when tool calls were
cut out between them. Streaming holds whitespace back until non-whitespace text follows, and the parsers hold back
any suffix that may be the start of a tag, so stream and one-shot results agree.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from gyre.proxy.conversation import (
    AssistantOutput,
    OutputEvent,
    StopReason,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallDone,
    ToolSpec,
)
from gyre.proxy.parsers.base import ContentItem, ReasoningItem
from gyre.proxy.parsers.registry import build_reasoning_parser, build_tool_call_parser, prompt_opens_thinking

__all__ = ["Detokenizer", "OutputDecoder", "OutputParser", "parse_output", "prompt_opens_thinking"]

ENGINE_FINISHES = ("stop", "length", "abort")
REPLACEMENT_CHAR = "\ufffd"


# ----------------------------------------------------------------------------- detokenizer


class Detokenizer:
    """Incremental decoding of token ids (`tokenizers.Tokenizer`) that never splits a UTF-8 character.

    The prefix/read-offset technique: the window `_ids` starts at a character boundary; `_ids[:_read]` has been
    emitted as `_read_text`; each feed decodes only the window and emits what lies beyond `_read_text` once the
    window's text no longer ends in U+FFFD (an incomplete character). When it does end in U+FFFD, the latest of the
    last few cuts where decoding the two sides apart equals decoding them together is a boundary that later bytes
    cannot move (a byte sequence spanning the cut would decode to more replacement characters apart than together),
    so the text before it is emitted at once: a chunk's complete characters never wait for its last one, and a
    genuine U+FFFD or invalid bytes cannot stall the stream. The window stays a few ids long, so the total cost is
    O(ids), except for a run of ids that each end inside a character (possible with merged CJK byte tokens): such a
    run is held until one ends on a boundary, as any decoder must.
    """

    CUT_CANDIDATES = 4  # a character spans at most 4 ids, so a boundary is among the last 4 cuts unless ids straddle

    def __init__(self, tokenizer: Any, *, skip_ids: Collection[int] = ()):
        self._tokenizer = tokenizer
        self._skip_ids = frozenset(skip_ids)
        self._ids: list[int] = []  # the window: ids from the last boundary on
        self._read = 0  # window ids up to here have been emitted
        self._read_text = ""  # decode(self._ids[:self._read])

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def feed(self, ids: Sequence[int]) -> str:
        """Append ids; return the text they completed (possibly "")."""
        fresh = [i for i in ids if i not in self._skip_ids]
        if not fresh:
            return ""
        self._ids.extend(fresh)
        text = self._decode(self._ids)
        if len(text) > len(self._read_text) and not text.endswith(REPLACEMENT_CHAR):
            return self._emit_until(len(self._ids), text)
        # The tail is an incomplete character (or a genuine U+FFFD, or invalid bytes): emit up to the latest cut
        # that is a boundary, i.e. where decoding both sides apart equals decoding them together.
        end = len(self._ids)
        for cut in range(end - 1, max(self._read, end - 1 - self.CUT_CANDIDATES), -1):
            left = self._decode(self._ids[:cut])
            if len(left) > len(self._read_text) and left + self._decode(self._ids[cut:]) == text:
                return self._emit_until(cut, left)
        return ""

    def _emit_until(self, cut: int, text: str) -> str:
        """Emit `text` = decode(window[:cut]) beyond what was emitted; window[:cut] ends on a boundary."""
        piece = text[len(self._read_text) :]
        # The old read point is a boundary too, so the new window starts there and its emitted text is `piece`.
        del self._ids[: self._read]
        self._read = cut - self._read
        self._read_text = piece
        return piece

    def flush(self) -> str:
        """Return all remaining text (an incomplete character becomes U+FFFD) and start afresh."""
        rest = self._decode(self._ids)[len(self._read_text) :] if self._ids else ""
        self._ids, self._read, self._read_text = [], 0, ""
        return rest


# ----------------------------------------------------------------------------- parser


class OutputParser:
    """Incremental parser of the model's output text into `OutputEvent`s (grammar in the module docstring).

    `tool_call_parser` and `reasoning_parser` are registry names (None: no reasoning split); `tools` are the
    request's (qwen3_coder types parameter values by their schema); `starts_in_thinking`: the generation prompt
    already opened thinking (`prompt_opens_thinking`)."""

    def __init__(
        self,
        *,
        new_call_id: Callable[[], str],
        tool_call_parser: str = "hermes",
        reasoning_parser: str | None = "qwen3",
        tools: Sequence[ToolSpec] = (),
        starts_in_thinking: bool = False,
    ):
        self._new_call_id = new_call_id
        self._reasoning = build_reasoning_parser(reasoning_parser, starts_in_thinking=starts_in_thinking)
        self._tool_calls = build_tool_call_parser(tool_call_parser, tools)
        self._text_started = False  # a non-whitespace text character was emitted
        self._held_whitespace = ""  # trailing whitespace of text, emitted only if more text follows
        self._text: list[str] = []
        self._thinking: list[str] = []
        self._calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> list[OutputEvent]:
        """Consume more output text; return the events it completed."""
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish()")
        events: list[OutputEvent] = []
        if text:
            self._route(self._reasoning.feed(text), events, final=False)
        return events

    def finish(self, engine_finish: str) -> tuple[list[OutputEvent], AssistantOutput]:
        """End of output: flush what was held back; return the last events and the whole parsed output.

        `engine_finish` is the engine's "stop" | "length" | "abort".
        """
        if engine_finish not in ENGINE_FINISHES:
            raise ValueError(f"engine_finish: expected one of {ENGINE_FINISHES}, got {engine_finish!r}")
        if self._finished:
            raise RuntimeError("OutputParser.finish called twice")
        events: list[OutputEvent] = []
        self._route(self._reasoning.feed("", final=True), events, final=True)
        self._finished = True
        stop_reason: StopReason
        if engine_finish == "stop":
            stop_reason = "tool_calls" if self._calls else "stop"
        else:
            stop_reason = "length" if engine_finish == "length" else "abort"
        output = AssistantOutput(
            text="".join(self._text),
            thinking="".join(self._thinking),
            tool_calls=tuple(self._calls),
            stop_reason=stop_reason,
        )
        return events, output

    def _route(self, items: list[ReasoningItem], events: list[OutputEvent], *, final: bool) -> None:
        """Thinking to events; content through the tool-call parser (flushed at the end)."""
        for item in items:
            if isinstance(item, ThinkingDelta):
                self._thinking.append(item.text)
                events.append(item)
            else:
                self._content(self._tool_calls.feed(item), events)
        if final:
            self._content(self._tool_calls.feed("", final=True), events)

    def _content(self, items: list[ContentItem], events: list[OutputEvent]) -> None:
        for item in items:
            if isinstance(item, str):
                self._emit_text(item, events)
            else:
                call = ToolCall(id=self._new_call_id(), name=item.name, arguments=item.arguments)
                self._calls.append(call)
                events.append(ToolCallDone(call))

    def _emit_text(self, piece: str, events: list[OutputEvent]) -> None:
        if not self._text_started:
            piece = piece.lstrip()
        core = piece.rstrip()
        if not core:
            self._held_whitespace += piece
            return
        out = self._held_whitespace + core
        self._held_whitespace = piece[len(core) :]
        self._text_started = True
        self._text.append(out)
        events.append(TextDelta(out))


def parse_output(text: str, engine_finish: str, *, new_call_id: Callable[[], str], **options: Any) -> AssistantOutput:
    """Parse a whole output text at once (same result as streaming it through an `OutputParser(**options)`)."""
    parser = OutputParser(new_call_id=new_call_id, **options)
    parser.feed(text)
    return parser.finish(engine_finish)[1]


class OutputDecoder:
    """Token ids -> events: a `Detokenizer` feeding an `OutputParser` (what the proxy runs per model call)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_ids: Collection[int] = (),
        new_call_id: Callable[[], str],
        tool_call_parser: str = "hermes",
        reasoning_parser: str | None = "qwen3",
        tools: Sequence[ToolSpec] = (),
        starts_in_thinking: bool = False,
    ):
        self._detokenizer = Detokenizer(tokenizer, skip_ids=skip_ids)
        self._parser = OutputParser(
            new_call_id=new_call_id,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            tools=tools,
            starts_in_thinking=starts_in_thinking,
        )

    def feed(self, ids: Sequence[int]) -> list[OutputEvent]:
        return self._parser.feed(self._detokenizer.feed(ids))

    def finish(self, engine_finish: str) -> tuple[list[OutputEvent], AssistantOutput]:
        events = self._parser.feed(self._detokenizer.flush())
        more, output = self._parser.finish(engine_finish)
        return events + more, output
