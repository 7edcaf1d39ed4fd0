"""Chat templating with TITO: a `ChatRequest` becomes the engine's prompt ids, as provenance-labelled segments.

Role: `ChatTemplate` (`gyre.proxy.template`) renders a model's chat template as transformers does;
`PromptBuilder` (one per execution) turns each request into a `Prompt`: a list of `gyre.traj.record.Segment`s
whose concatenated ids are exactly what the engine sees.

Contract:
- One segment per turn (plus a SYSTEM header: system prompt and tools). Every assistant turn's content is a
  segment of its own: the generation prompt (`<|im_start|>assistant\\n`) ends the segment before it, and the
  template's glue after the content (`\\n` after the stop token, or `<|im_end|>\\n` when our output hit the
  length limit) starts the segment after it. An assistant turn we produced (restored through the
  `PayloadCache` by tool-call id or content) is then exactly our recorded output ids, so its key equals the
  recorded response's key and the trajectory tree walks through it; any other assistant turn is rendered by
  the template (HARNESS_ASSISTANT).
- TITO: when a request extends the previous request of the execution (same system prompt and tools, turns a
  prefix), the earlier turns' `Segment` objects are reused verbatim (never re-rendered, re-encoded or rehashed);
  only the new turns are rendered, in a small window (a stub system message, a stub of the previous turn, the
  new turns and a stub of the next turn), so the cost per request does not grow with the history. The window
  is trusted only if a probe conversation renders identically that way and in one piece
  (`windowed_rendering`); otherwise every request renders the whole conversation (correct, slower;
  `Prompt.fallbacks`).
- Provenance: system prompt, tools and mid-conversation system messages SYSTEM; user USER; tool TOOL; restored
  assistant SAMPLED; other assistant HARNESS_ASSISTANT; pure template glue between two assistant turns SYSTEM.
- A mid-conversation system message is rendered with the system role if the template accepts and renders it,
  else as a user message (still SYSTEM provenance).
Pure: no IO except `ChatTemplate.from_pretrained`, which reads the model directory.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from gyre.proxy.conversation import ApiError, ChatRequest, ToolCall, ToolSpec, Turn
from gyre.proxy.payload import PayloadCache
from gyre.proxy.template import (  # ChatTemplate is re-exported: callers build both from here
    TOOL_STUB,
    USER_STUB,
    ChatTemplate,
    RenderError,
    common_prefix_len,
)
from gyre.traj.record import Provenance, Segment

__all__ = ["ChatTemplate", "PayloadCache", "Prompt", "PromptBuilder", "PromptTooLong", "windowed_rendering"]

DEFAULT_CHUNK_TURNS = 8  # new turns rendered per window: renders per window grow with its square
_ROLE_PROVENANCE = {"system": Provenance.SYSTEM, "user": Provenance.USER, "tool": Provenance.TOOL}


class _NeedsFullRender(Exception):
    """The window cannot render these turns faithfully; render the whole conversation instead."""


class PromptTooLong(Exception):
    """The prompt has more tokens than `build`'s `max_tokens`: at least `at_least` (the builder stopped counting)."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the prompt has at least {at_least} tokens > {limit}")
        self.at_least, self.limit = at_least, limit


@dataclass(eq=False)
class Prompt:
    """The engine's prompt for one request, as segments; `input_ids` is their concatenation."""

    segments: list[Segment]
    num_tokens: int
    reused_turns: int  # leading turns whose segments came from the previous request, untouched
    rendered_turns: int  # turns rendered and encoded for this request
    restored_turns: int  # assistant turns restored from the payload cache (SAMPLED, our exact ids)
    unrestored_assistant_turns: int  # assistant turns rendered by the template (HARNESS_ASSISTANT)
    reused_segments: int  # leading segments identical (same objects) to the previous request's
    reused_tokens: int  # their tokens
    fallbacks: int = 0  # 1: whole conversation rendered; 2: not even that splits, one USER segment
    texts: list[str | None] = field(default_factory=list, repr=False)  # per segment; None: restored ids
    previous: Prompt | None = field(default=None, repr=False)  # the thread's previous prompt (its ids are reused)

    @cached_property
    def input_ids(self) -> array:
        """The concatenated ids; the `reused_segments` shared with the previous prompt are one slice of its ids."""
        shared = self.reused_segments if self.previous is not None else 0
        ids = self.previous.input_ids[: self.reused_tokens] if shared else array("i")
        for segment in self.segments[shared:]:
            ids.extend(segment.ids)
        self.previous = None  # the slice is taken: do not keep the previous prompt alive
        return ids


@dataclass(eq=False, slots=True)
class _Entry:
    """What one turn contributed to the last prompt, and what a later request needs to reuse it."""

    segments: tuple[Segment, ...]
    texts: tuple[str | None, ...]
    next_role: str  # role of the following turn when built ("assistant" if it was last: the generation prompt)
    glue: str  # text the next segment starts with (after an assistant turn)
    ends_with_assistant: bool  # the last segment is assistant content (no generation prompt appended)
    seg_end: int  # number of prompt segments through this turn
    tokens_end: int
    restored: bool
    unrestored: bool


class PromptBuilder:
    """Per execution: builds each request's `Prompt`, reusing the previous request's segments for its prefix."""

    def __init__(
        self,
        template: ChatTemplate,
        payloads: PayloadCache | None = None,
        *,
        chunk_turns: int = DEFAULT_CHUNK_TURNS,
        windowed: bool | None = None,
    ) -> None:
        if chunk_turns < 1:
            raise ValueError(f"chunk_turns={chunk_turns!r}: expected an int >= 1")
        self.template = template
        self.payloads = payloads if payloads is not None else PayloadCache()
        self.chunk_turns = chunk_turns
        self._windowed = windowed
        self._system: str | None = None
        self._tools: tuple[ToolSpec, ...] | None = None
        self._turns: tuple[Turn, ...] = ()
        self._entries: list[_Entry] = []
        self._header: _Entry | None = None
        self._segments: list[Segment] = []
        self._texts: list[str | None] = []
        self._prompt: Prompt | None = None  # the last prompt built (its ids seed the next one's)
        self._max_tokens: int | None = None  # the limit of the build under way (builds of one builder never overlap)
        self._suffix = ""  # the build's generation suffix (enable_thinking), after the last generation prompt
        self._built_suffix = ""  # the suffix the last prompt ends with

    @property
    def windowed(self) -> bool:
        return windowed_rendering(self.template) if self._windowed is None else self._windowed

    def build(
        self, request: ChatRequest, *, max_tokens: int | None = None, enable_thinking: bool | None = None
    ) -> Prompt:
        """The prompt of `request`. Raises ApiError(invalid_request) if the chat template refuses it.

        `enable_thinking`: rendered into the final generation prompt only (`ChatTemplate.generation_suffix`, e.g.
        Qwen3's empty thinking block for False); an earlier turn keeps the tokens its call was given.

        `max_tokens`: raise PromptTooLong (and keep the previous request's state) as soon as the prompt must pass
        it: before encoding a text whose token floor alone passes it (`ChatTemplate.min_tokens`), or once the
        ids encoded so far do. A huge prompt is then refused without tokenizing it. None: no limit."""
        self._max_tokens = max_tokens
        self._suffix = self.template.generation_suffix(enable_thinking)
        try:
            prompt = self._build(request)
        finally:
            self._max_tokens = None
        self._built_suffix = self._suffix
        return prompt

    def pending_turns(self, request: ChatRequest) -> Sequence[Turn]:
        """The turns `build(request)` will likely render and encode: those past the previous request's (all of
        them when the system prompt or tools changed). Cheap: no comparison of turns."""
        same_head = self._tools is not None and request.system == self._system and request.tools == self._tools
        return request.turns[len(self._turns) :] if same_head else request.turns

    def pending_chars(self, request: ChatRequest) -> int:
        """About how many characters `build(request)` renders and encodes (`pending_turns`, plus the system prompt
        when it is rendered anew)."""
        turns = self.pending_turns(request)
        head = len(request.system or "") if len(turns) == len(request.turns) else 0
        return head + sum(len(turn.text) for turn in turns)

    def _encode(self, text: str, before: int) -> list[int]:
        """The ids of `text`, which starts `before` tokens into the prompt, within the build's `max_tokens`."""
        limit = self._max_tokens
        if limit is not None:
            floor = before + self.template.min_tokens(text)
            if floor > limit:
                raise PromptTooLong(floor, limit)
        ids = self.template.encode(text)
        if limit is not None and before + len(ids) > limit:
            raise PromptTooLong(before + len(ids), limit)
        return ids

    def _build(self, request: ChatRequest) -> Prompt:
        turns = request.turns
        same_head = self._tools is not None and request.system == self._system and request.tools == self._tools
        if not self.windowed:
            return self._build_full(request, fallback=1)
        if not same_head:
            return self._build_full(request, fallback=0, windowed=True)
        reused = 0
        previous = self._turns
        for new, old in zip(turns, previous, strict=False):
            if new is not old and new != old:
                break
            reused += 1
        if reused and self._entries[reused - 1].next_role != _next_role(turns, reused):
            reused -= 1  # its rendering depends on what follows (generation prompt, grouped tool results)
        elif reused == len(turns) == len(previous) and self._suffix != self._built_suffix:
            reused -= 1  # a retry with another enable_thinking: its generation prompt ends differently
        if reused == 0:
            return self._build_full(request, fallback=0, windowed=True)
        try:
            return self._extend(request, reused)
        except _NeedsFullRender:
            return self._build_full(request, fallback=1)

    # -- extension: render only the new turns ------------------------------------------------------
    def _extend(self, request: ChatRequest, reused: int) -> Prompt:
        turns = request.turns
        texts = self._window_texts(request, reused, len(turns))[1]
        base = self._entries[reused - 1]
        entries = self._assemble(turns, reused, texts, base)
        return self._commit(request, self._entries[:reused] + entries, self._header, reused, fallbacks=0)

    def _window_texts(self, request: ChatRequest, start: int, stop: int) -> tuple[str, list[str]]:
        """(header text if start == 0, text of each turn in [start, stop)), rendered in windows of chunk_turns."""
        template, turns = self.template, request.turns
        leading_system_turn = request.system is None and bool(turns) and turns[0].role == "system"
        has_system = request.system is not None or leading_system_turn
        stub_tools = [ToolSpec(name="f").as_template_tool()] if request.tools else None
        header, texts = "", []
        for a in range(start, stop, self.chunk_turns):
            b = min(a + self.chunk_turns, stop)
            if a == 0:
                context = [{"role": "system", "content": request.system}] if request.system is not None else []
                tools = [tool.as_template_tool() for tool in request.tools]
            else:
                context = [{"role": "system", "content": "s"}] if has_system else []
                context.append(_stub(template, turns[a - 1]))
                tools = stub_tools
            lookahead = _stub(template, turns[b]) if b < len(turns) else {"role": "assistant", "content": "x"}
            chunk = [template.message(turns[i], first=leading_system_turn and i == 0) for i in range(a, b)]
            try:
                chunk_header, chunk_texts = _split_render(template, context, chunk, lookahead, tools)
            except RenderError as err:
                raise _NeedsFullRender() from err
            if a == 0:
                header = chunk_header
            texts.extend(chunk_texts)
        return header, texts

    # -- whole conversation ------------------------------------------------------------------------
    def _build_full(self, request: ChatRequest, *, fallback: int, windowed: bool = False) -> Prompt:
        turns = request.turns
        if windowed:
            try:
                header, texts = self._window_texts(request, 0, len(turns))
                header_entry = self._header_entry(request, header, turns, texts)
                entries = self._assemble(turns, 0, texts, header_entry)
                return self._commit(request, entries, header_entry, 0, fallbacks=0)
            except _NeedsFullRender:
                fallback = 1
        template = self.template
        messages = template.messages(request)
        tools = [tool.as_template_tool() for tool in request.tools]
        offset = 1 if request.system is not None else 0
        try:
            closed = template.render(messages, tools)
            full = template.render(messages, tools, add_generation_prompt=True)
        except RenderError as err:
            raise ApiError("invalid_request", str(err), param="messages") from err
        if full.startswith(closed) and full[len(closed) :] == template.generation_prompt:
            # (the suffix is added by _assemble to the final generation prompt, as in windowed builds)
            context = messages[:offset]
            header, texts = _split_text(template, context, messages[offset:], tools, closed)
            header_entry = self._header_entry(request, header, turns, texts)
            try:
                entries = self._assemble(turns, 0, texts, header_entry, inline=True)
                return self._commit(request, entries, header_entry, 0, fallbacks=fallback or 1)
            except _NeedsFullRender:
                pass
        # Last resort: correct ids, no sharing, no restore; the next request starts afresh.
        full += self._suffix
        segment = Segment(Provenance.USER, self._encode(full, 0))
        self._reset()
        return Prompt([segment], len(segment), 0, len(turns), 0, 0, 0, 0, fallbacks=2, texts=[full])

    def _header_entry(self, request: ChatRequest, header: str, turns, texts) -> _Entry:
        first_is_assistant = bool(turns) and turns[0].role == "assistant"
        if not header:
            return _Entry((), (), "", "", True, 0, 0, False, False)
        prompt_text = self.template.generation_prompt
        text = header + (prompt_text if first_is_assistant else prompt_text + self._suffix if not turns else "")
        old = self._header
        segment = (
            old.segments[0]
            if old is not None and old.texts and old.texts[0] == text
            else Segment(Provenance.SYSTEM, self._encode(text, 0))
        )
        return _Entry((segment,), (text,), "", "", False, 1, len(segment), False, False)

    # -- segments from per-turn texts --------------------------------------------------------------
    def _assemble(
        self,
        turns: Sequence[Turn],
        start: int,
        texts: Sequence[str],
        base: _Entry,
        *,
        inline: bool = False,
    ) -> list[_Entry]:
        """Entries for turns[start:] given their rendered texts; `base` is the entry (or header) before them.

        `inline`: an assistant text the template does not frame as generation prompt + content + footer is
        kept as one HARNESS_ASSISTANT text segment instead of failing over to a whole-conversation render.
        """
        template = self.template
        prompt_text, footer = template.generation_prompt, template.assistant_footer
        stop_text = template.footer_stop_text
        n = len(turns)
        bodies: list[str | None] = []
        for j in range(start, n):
            text = texts[j - start]
            body = None
            if turns[j].role == "assistant" and footer and text.startswith(prompt_text) and text.endswith(footer):
                body = text[len(prompt_text) : len(text) - len(footer)] + stop_text
            if turns[j].role == "assistant" and body is None and not inline:
                raise _NeedsFullRender()
            bodies.append(body)
        old_entries = self._entries
        seg_end, tokens_end = base.seg_end, base.tokens_end
        lead = base.glue
        prev_has_prompt = not base.ends_with_assistant and base.seg_end > 0
        entries: list[_Entry] = []
        for j in range(start, n):
            turn, text, body = turns[j], texts[j - start], bodies[j - start]
            last = j == n - 1
            next_is_split_assistant = last or bodies[j + 1 - start] is not None
            old = old_entries[j] if j < len(old_entries) else None
            pieces: list[tuple[Provenance, str | None, Segment | None]] = []
            restored = unrestored = False
            if body is not None:
                if not prev_has_prompt:  # glue between two assistant turns (or nothing before this one)
                    pieces.append((Provenance.SYSTEM, lead + prompt_text, None))
                sampled = self.payloads.restore_segment(turn)
                if sampled is not None:
                    pieces.append((Provenance.SAMPLED, None, sampled))
                    glue = template.glue_after(sampled.ids)
                    restored = True
                else:
                    pieces.append((Provenance.HARNESS_ASSISTANT, body, None))
                    glue = footer[len(stop_text) :]
                    unrestored = True
                if last:  # the request ends with an assistant turn: a new one is generated after it
                    pieces.append((Provenance.SYSTEM, glue + prompt_text + self._suffix, None))
                lead, prev_has_prompt = ("" if last else glue), last
            else:
                provenance = _ROLE_PROVENANCE.get(turn.role, Provenance.HARNESS_ASSISTANT)
                unrestored = turn.role == "assistant"
                full_text = lead + text + (prompt_text if next_is_split_assistant else "")
                full_text += self._suffix if last else ""  # the final generation prompt's end (enable_thinking)
                if full_text:
                    pieces.append((provenance, full_text, None))
                lead, prev_has_prompt = "", next_is_split_assistant and bool(full_text or prev_has_prompt)
            segments, seg_texts = [], []
            for index, (provenance, piece_text, segment) in enumerate(pieces):
                if segment is None:
                    if (
                        old is not None
                        and index < len(old.texts)
                        and old.texts[index] == piece_text
                        and old.segments[index].provenance is provenance
                    ):
                        segment = old.segments[index]  # same text as last time: same object, no rehash
                    else:
                        segment = Segment(provenance, self._encode(piece_text, tokens_end))
                segments.append(segment)
                seg_texts.append(piece_text)
                tokens_end += len(segment)
            seg_end += len(segments)
            entries.append(
                _Entry(
                    tuple(segments),
                    tuple(seg_texts),
                    _next_role(turns, j + 1),
                    lead,
                    body is not None and not last,
                    seg_end,
                    tokens_end,
                    restored,
                    unrestored,
                )
            )
        return entries

    def _commit(
        self, request: ChatRequest, entries: list[_Entry], header: _Entry | None, reused: int, *, fallbacks: int
    ) -> Prompt:
        reuse_segments = entries[reused - 1].seg_end if reused else 0
        segments = self._segments[:reuse_segments] if reused else list(header.segments if header else ())
        texts = self._texts[:reuse_segments] if reused else list(header.texts if header else ())
        for entry in entries[reused:]:
            segments.extend(entry.segments)
            texts.extend(entry.texts)
        # Leading segments that are the previous prompt's objects, and their tokens: the reused entries' without a
        # walk (their segments are the previous list's), then any further ones.
        same, same_tokens = (reuse_segments, entries[reused - 1].tokens_end) if reused else (0, 0)
        previous_segments = self._segments
        while same < min(len(segments), len(previous_segments)) and segments[same] is previous_segments[same]:
            same_tokens += len(segments[same])
            same += 1
        self._system, self._tools, self._turns = request.system, request.tools, request.turns
        self._entries, self._header, self._segments, self._texts = entries, header, segments, texts
        new_entries = entries[reused:]
        previous, self._prompt = self._prompt, None
        self._prompt = Prompt(
            segments=segments,
            num_tokens=entries[-1].tokens_end if entries else (header.tokens_end if header else 0),
            reused_turns=reused,
            rendered_turns=len(new_entries),
            restored_turns=sum(entry.restored for entry in new_entries),
            unrestored_assistant_turns=sum(entry.unrestored for entry in new_entries),
            reused_segments=same,
            reused_tokens=same_tokens,
            fallbacks=fallbacks,
            texts=texts,
            # only a prompt whose ids exist (cached_property keeps them in __dict__): never a chain of prompts
            previous=previous if previous is not None and same and "input_ids" in previous.__dict__ else None,
        )
        return self._prompt

    def _reset(self) -> None:
        self._system, self._tools, self._turns = None, None, ()
        self._entries, self._header, self._segments, self._texts = [], None, [], []
        self._prompt = None


def _next_role(turns: Sequence[Turn], index: int) -> str:
    return turns[index].role if index < len(turns) else "assistant"


def _stub(template: ChatTemplate, turn: Turn) -> dict[str, Any]:
    """A minimal message of the same role: what a neighbouring turn contributes to a window."""
    if turn.role == "tool":
        return {"role": "tool", "content": "x", "tool_call_id": turn.tool_call_id}
    if turn.role == "system":
        return {"role": template.mid_system_role, "content": "x"}
    return {"role": turn.role, "content": "x"}


def _split_render(template: ChatTemplate, context, chunk, lookahead, tools) -> tuple[str, list[str]]:
    """Render context + chunk + lookahead once; cut it at message boundaries (common prefixes with the
    renders of each prefix). Returns (text before the chunk, text of each chunk message)."""
    window = [*context, *chunk, lookahead]
    full = template.render(window, tools)
    return _split_text(template, context, [*chunk, lookahead], tools, full, drop_last=True)


def _split_text(template, context, messages, tools, full: str, drop_last: bool = False) -> tuple[str, list[str]]:
    window = [*context, *messages]
    count = len(messages) - (1 if drop_last else 0)
    bounds: list[int] = []
    previous = 0
    for j in range(len(context), len(context) + count + 1):
        if j == len(window):
            bound = len(full)
        else:
            try:
                # j == 0 too: with tools and no system message the template still writes a header
                bound = _prefix_bound(template, window[:j], tools, full)
            except RenderError:
                bound = previous  # a prefix the template refuses: its text joins the next message
        bound = max(bound, previous)
        bounds.append(bound)
        previous = bound
    return full[: bounds[0]], [full[bounds[i] : bounds[i + 1]] for i in range(count)]


def _prefix_bound(template: ChatTemplate, prefix: list, tools, full: str) -> int:
    """Where the text of `prefix`'s messages ends in `full` (a render of `prefix` and more messages)."""
    if not (template.last_assistant_differs and prefix and prefix[-1].get("role") == "assistant"):
        return common_prefix_len(template.render(prefix, tools), full)
    # The template renders a last assistant message its own way (Qwen3: an empty thinking block first): render it
    # followed by a stub and cut after its footer (the stub's head may share characters with the next message's).
    # Two stubs, the longer match kept: Qwen3 shows an assistant's thinking only after the last user query, so a
    # tool stub renders it as a turn with no user message after it would read, a user stub as one followed by one.
    shared = max(common_prefix_len(template.render([*prefix, stub], tools), full) for stub in (TOOL_STUB, USER_STUB))
    footer = template.assistant_footer
    at = full.rfind(footer, 0, shared) if footer else -1
    return at + len(footer) if at >= 0 else 0


def _window_matches_full_render(template: ChatTemplate) -> bool:
    """Probe: do windowed, incremental builds give the one-piece render's text for a tool-using conversation?"""
    call = ToolCall(id="c1", name="f", arguments='{"a": 1}')
    turns = [
        Turn(role="user", text="u1"),
        Turn(role="assistant", text="a1", tool_calls=(call, ToolCall(id="c2", name="g", arguments="{}"))),
        Turn(role="tool", text="r1", tool_call_id="c1"),
        Turn(role="tool", text="r2", tool_call_id="c2"),
        Turn(role="assistant", text="a2", tool_calls=(ToolCall(id="c3", name="f", arguments='{"a": 2}'),)),
        Turn(role="tool", text="r3", tool_call_id="c3"),
        Turn(role="user", text="u2"),
        Turn(role="system", text="s2"),
        Turn(role="assistant", text="a3"),
        Turn(role="user", text="u3"),
    ]
    tools = (ToolSpec(name="f", description="d", parameters={"type": "object"}),)
    for system in ("sys", None):
        builder = PromptBuilder(template, PayloadCache(), chunk_turns=2, windowed=True)
        for stop in range(1, len(turns) + 1):
            if turns[stop - 1].role == "assistant":
                continue  # a request ends with a non-assistant turn (templates treat a final assistant specially)
            request = ChatRequest(
                dialect="openai_chat", model="m", system=system, turns=tuple(turns[:stop]), tools=tools
            )
            try:
                prompt = builder.build(request)
                expected = template.render_request(request)
            except (RenderError, ApiError):
                return False
            if prompt.fallbacks or "".join(t or "" for t in prompt.texts) != expected:
                return False
    return True


@functools.cache
def windowed_rendering(template: ChatTemplate) -> bool:
    """True if rendering new turns in a small window reproduces the whole-conversation render (probed once)."""
    return _window_matches_full_render(template)
