"""Output token ids -> text, thinking and tool calls, incrementally (streaming) or at once, with identical results.

Role: the proxy feeds the engine's output ids into an `OutputDecoder` (a `Detokenizer` then an `OutputParser`) and
hands the `OutputEvent`s to a dialect's stream writer, or the final `AssistantOutput` to its JSON writer. Pure: no IO.

Contract:
- `Detokenizer`: `"".join(feed(...) pieces) + flush() == tokenizer.decode(ids without skip_ids,
  skip_special_tokens=False)` for byte-level tokenizers; `feed` never returns a partial character.
- `OutputParser`: for any chunking of a text, the events of `feed(...)* + finish()` equal (after merging adjacent
  deltas of one kind) the events of feeding the whole text at once, and the `AssistantOutput` is their merge:
  `text` = the TextDeltas joined, `thinking` = the ThinkingDeltas joined, `tool_calls` = the ToolCallDones.
  It never raises on model output: whatever cannot be parsed is returned as text.

Output grammar (Qwen2.5/Qwen3/Hermes, and gyre's tiny model, whose template is the same ChatML):
- Thinking: `<think>` at the very start of the output (after optional whitespace), or `starts_in_thinking=True`
  when the generation prompt already opened it, up to `</think>` (or to the end of the output if it never closes).
  Template glue stripped like Qwen3's own template does (`reasoning.strip("\\n")`, `content.lstrip("\\n")`): every
  "\\n" right after `<think>` and right before `</think>`; other whitespace inside thinking is kept. A `<think>`
  later in the output is plain text; tool-call tags inside thinking are plain thinking.
- Tool calls: `<tool_call>` BODY `</tool_call>` anywhere outside thinking. BODY must be one JSON object
  (surrounding whitespace allowed) with a non-empty string "name" and "arguments" that is an object, or a string
  holding a JSON object; "parameters" is read when "arguments" is missing, and neither means no arguments ("{}").
  The call's `arguments` is the exact text of that object as the model wrote it (sliced from BODY), or the inner
  string (stripped) in the string form. JSON is strict (no NaN/Infinity, no raw control characters in strings,
  as `json.loads` in vLLM's Hermes parser). When BODY starts with "{", a `</tool_call>` inside a JSON string
  literal of BODY does not close the block (the first one outside a string does); otherwise the first one closes
  it (Qwen's parser). A block that does not parse, or is unterminated at finish, is returned as text, tags included.
- Text: everything else. Final text is stripped of leading and trailing whitespace (`str.strip`), so whitespace
  around tool calls (their "\\n" glue) and after `</think>` vanishes; whitespace between two pieces of text is
  kept, even when tool calls were cut out between them. Streaming holds whitespace back until non-whitespace text
  follows, and holds back any suffix that may be the start of a tag, so stream and one-shot results agree.
"""

from __future__ import annotations

import json
import re
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
)

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


# ----------------------------------------------------------------------------- tool-call bodies

_JSON_WS = re.compile(r"[ \t\n\r]*")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


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


def parse_tool_call_body(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a tool-call body, or None when it is not a valid call (module docstring)."""
    text = body.strip()
    members = _object_members(text)
    if members is None or "name" not in members:
        return None
    name = members["name"][0]
    if not isinstance(name, str) or not name:
        return None
    key = "arguments" if "arguments" in members else "parameters"
    if key not in members:
        return name, "{}"
    value, start, end = members[key]
    if isinstance(value, dict):
        return name, text[start:end]
    if isinstance(value, str):
        inner = value.strip()
        try:
            decoded = json.loads(inner, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
        return (name, inner) if isinstance(decoded, dict) else None
    return None


# ----------------------------------------------------------------------------- parser


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


_START, _THINKING, _TEXT, _CALL = "start", "thinking", "text", "call"


class OutputParser:
    """Incremental parser of the model's output text into `OutputEvent`s (grammar in the module docstring)."""

    def __init__(
        self,
        *,
        new_call_id: Callable[[], str],
        thinking_open: str = "<think>",
        thinking_close: str = "</think>",
        call_open: str = "<tool_call>",
        call_close: str = "</tool_call>",
        starts_in_thinking: bool = False,
    ):
        tags = {
            "thinking_open": thinking_open,
            "thinking_close": thinking_close,
            "call_open": call_open,
            "call_close": call_close,
        }
        for field_name, tag in tags.items():
            if not isinstance(tag, str) or not tag or tag != tag.strip():
                raise ValueError(f"{field_name}: expected a non-empty tag without surrounding whitespace, got {tag!r}")
        self._new_call_id = new_call_id
        self._thinking_open, self._thinking_close = thinking_open, thinking_close
        self._call_open, self._call_close = call_open, call_close
        self._mode = _THINKING if starts_in_thinking else _START
        self._buf = ""  # text of the current mode not yet consumed
        self._thinking_started = False  # a thinking character other than "\n" was emitted
        self._held_newlines = ""  # trailing "\n"s of thinking, emitted only if more thinking follows
        self._text_started = False  # a non-whitespace text character was emitted
        self._held_whitespace = ""  # trailing whitespace of text, emitted only if more text follows
        self._reset_call_scan()
        self._text: list[str] = []
        self._thinking: list[str] = []
        self._calls: list[ToolCall] = []
        self._finished = False

    def _reset_call_scan(self) -> None:
        self._scan = 0  # position in self._buf (the call body) scanned so far
        self._json_body: bool | None = None  # the body's first non-whitespace character is "{" (None: not seen)
        self._in_string = False
        self._escaped = False

    # --------------------------------------------------------------------- public

    def feed(self, text: str) -> list[OutputEvent]:
        """Consume more output text; return the events it completed."""
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish()")
        events: list[OutputEvent] = []
        if text:
            self._buf += text
            self._advance(events, final=False)
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
        self._advance(events, final=True)
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

    # --------------------------------------------------------------------- state machine

    def _advance(self, events: list[OutputEvent], *, final: bool) -> None:
        step = {
            _START: self._step_start,
            _THINKING: self._step_thinking,
            _TEXT: self._step_text,
            _CALL: self._step_call,
        }
        while step[self._mode](events, final):
            pass

    def _step_start(self, events: list[OutputEvent], final: bool) -> bool:
        # Leading whitespace is dropped either way: before <think>, or as the start of the (stripped) text.
        self._buf = self._buf.lstrip()
        if self._buf.startswith(self._thinking_open):
            self._buf = self._buf[len(self._thinking_open) :]
            self._mode = _THINKING
            return True
        if self._thinking_open.startswith(self._buf) and not final:
            return False  # empty, or maybe the start of <think>
        self._mode = _TEXT
        return True

    def _step_thinking(self, events: list[OutputEvent], final: bool) -> bool:
        end = self._buf.find(self._thinking_close)
        if end >= 0:
            self._emit_thinking(self._buf[:end], events)
            self._held_newlines = ""  # the "\n" before </think> is glue
            self._buf = self._buf[end + len(self._thinking_close) :]
            self._mode = _TEXT
            return True
        keep = 0 if final else _partial_tag_len(self._buf, self._thinking_close)
        self._emit_thinking(self._buf[: len(self._buf) - keep], events)
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _step_text(self, events: list[OutputEvent], final: bool) -> bool:
        start = self._buf.find(self._call_open)
        if start >= 0:
            self._emit_text(self._buf[:start], events)
            self._buf = self._buf[start + len(self._call_open) :]
            self._reset_call_scan()
            self._mode = _CALL
            return True
        keep = 0 if final else _partial_tag_len(self._buf, self._call_open)
        self._emit_text(self._buf[: len(self._buf) - keep], events)
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _step_call(self, events: list[OutputEvent], final: bool) -> bool:
        end = self._find_call_close()
        if end is None:
            if final:  # unterminated: the raw block is text
                self._emit_text(self._call_open + self._buf, events)
                self._buf = ""
            return False
        body = self._buf[:end]
        self._buf = self._buf[end + len(self._call_close) :]
        self._mode = _TEXT
        parsed = parse_tool_call_body(body)
        if parsed is None:
            self._emit_text(self._call_open + body + self._call_close, events)
        else:
            call = ToolCall(id=self._new_call_id(), name=parsed[0], arguments=parsed[1])
            self._calls.append(call)
            events.append(ToolCallDone(call))
        return True

    def _find_call_close(self) -> int | None:
        """Index in the body buffer of the closing tag, skipping tags inside JSON strings; None if not there yet."""
        buf, close = self._buf, self._call_close
        i, n = self._scan, len(buf)
        while i < n:
            c = buf[i]
            if self._in_string:
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
                    return i
                if close.startswith(buf[i:]):
                    break  # maybe the closing tag, cut by the chunking: wait for more
            if self._json_body is None and not c.isspace():
                self._json_body = c == "{"
            if c == '"' and self._json_body:
                self._in_string = True
            i += 1
        self._scan = i
        return None

    # --------------------------------------------------------------------- emission

    def _emit_thinking(self, piece: str, events: list[OutputEvent]) -> None:
        if not self._thinking_started:
            piece = piece.lstrip("\n")  # the "\n" after <think> is glue
        core = piece.rstrip("\n")
        if not core:
            self._held_newlines += piece
            return
        out = self._held_newlines + core
        self._held_newlines = piece[len(core) :]
        self._thinking_started = True
        self._thinking.append(out)
        events.append(ThinkingDelta(out))

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


def parse_output(
    text: str, engine_finish: str, *, new_call_id: Callable[[], str], **tag_options: Any
) -> AssistantOutput:
    """Parse a whole output text at once (same result as streaming it through an `OutputParser`)."""
    parser = OutputParser(new_call_id=new_call_id, **tag_options)
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
        **tag_options: Any,
    ):
        self._detokenizer = Detokenizer(tokenizer, skip_ids=skip_ids)
        self._parser = OutputParser(new_call_id=new_call_id, **tag_options)

    def feed(self, ids: Sequence[int]) -> list[OutputEvent]:
        return self._parser.feed(self._detokenizer.feed(ids))

    def finish(self, engine_finish: str) -> tuple[list[OutputEvent], AssistantOutput]:
        events = self._parser.feed(self._detokenizer.flush())
        more, output = self._parser.finish(engine_finish)
        return events + more, output
