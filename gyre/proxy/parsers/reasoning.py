"""Reasoning marked by `<think>...</think>` (SGLang `qwen3`, `qwen3-thinking`, `deepseek-r1`), or none (`none`).

`ThinkTags`: thinking is `<think>` at the very start of the output (after optional whitespace) up to `</think>`, or
to the end of the output if it never closes. With `starts_in_thinking` (the generation prompt already opened
`<think>`, or the parser is `qwen3-thinking` / `deepseek-r1`, whose models think without writing the opening tag)
the output starts inside thinking, and a `<think>` it still writes first (after optional whitespace) is dropped.
Template glue is stripped as Qwen3's own template does (`reasoning.strip("\\n")`): every "\\n" right after the
opening and right before `</think>`; other whitespace inside thinking is kept. A `<think>` later in the output is
content, and tool-call tags inside thinking are thinking (SGLang's `qwen3` instead ends thinking at a
`<tool_call>`, for Qwen3.5 outputs that forget `</think>`).

`NoReasoning`: the whole output is content.
"""

from __future__ import annotations

from gyre.proxy.conversation import ThinkingDelta
from gyre.proxy.parsers.base import ReasoningItem, partial_tag_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_START, _OPENED, _THINKING, _CONTENT = "start", "opened", "thinking", "content"


class ThinkTags:
    def __init__(self, *, starts_in_thinking: bool = False, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE):
        self._open, self._close = open_tag, close_tag
        self._mode = _OPENED if starts_in_thinking else _START
        self._buf = ""
        self._started = False  # a thinking character other than "\n" was emitted
        self._held_newlines = ""  # trailing "\n"s of thinking, emitted only if more thinking follows

    def feed(self, text: str, *, final: bool = False) -> list[ReasoningItem]:
        self._buf += text
        items: list[ReasoningItem] = []
        step = {_START: self._step_start, _OPENED: self._step_opened, _THINKING: self._step_thinking}
        while self._mode != _CONTENT and step[self._mode](items, final):
            pass
        if self._mode == _CONTENT and self._buf:
            items.append(self._buf)
            self._buf = ""
        return items

    def _step_start(self, items: list[ReasoningItem], final: bool) -> bool:
        # Leading whitespace is dropped either way: before <think>, or as the start of the (stripped) text.
        self._buf = self._buf.lstrip()
        if self._buf.startswith(self._open):
            self._buf = self._buf[len(self._open) :]
            self._mode = _THINKING
            return True
        if self._open.startswith(self._buf) and not final:
            return False  # empty, or maybe the start of <think>
        self._mode = _CONTENT
        return True

    def _step_opened(self, items: list[ReasoningItem], final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(self._open):
            self._buf = stripped[len(self._open) :]
        elif self._open.startswith(stripped) and not final:
            return False  # maybe a <think> the model writes anyway
        self._mode = _THINKING
        return True

    def _step_thinking(self, items: list[ReasoningItem], final: bool) -> bool:
        end = self._buf.find(self._close)
        if end >= 0:
            self._emit(self._buf[:end], items)
            self._held_newlines = ""  # the "\n" before </think> is glue
            self._buf = self._buf[end + len(self._close) :]
            self._mode = _CONTENT
            return True
        keep = 0 if final else partial_tag_len(self._buf, self._close)
        self._emit(self._buf[: len(self._buf) - keep], items)
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _emit(self, piece: str, items: list[ReasoningItem]) -> None:
        if not self._started:
            piece = piece.lstrip("\n")  # the "\n" after <think> is glue
        core = piece.rstrip("\n")
        if not core:
            self._held_newlines += piece
            return
        items.append(ThinkingDelta(self._held_newlines + core))
        self._held_newlines = piece[len(core) :]
        self._started = True


class NoReasoning:
    def feed(self, text: str, *, final: bool = False) -> list[ReasoningItem]:
        return [text] if text else []
