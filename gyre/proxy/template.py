"""A model's chat template and tokenizer, rendered as `transformers.apply_chat_template` does (no model hub).

`ChatTemplate.from_pretrained(model_dir)` reads `tokenizer.json` and the Jinja `chat_template` of
`tokenizer_config.json` from a local HF-layout directory; `render` uses transformers' sandboxed environment
(trim_blocks, lstrip_blocks, loopcontrols, `tojson`, `raise_exception`, `strftime_now`). It also knows the
template's shape the prompt builder (`gyre.proxy.render`) relies on: the generation prompt, the assistant footer
and how a mid-conversation system message renders. Pure except `from_pretrained`, which reads the directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from gyre.proxy.conversation import ChatRequest, ToolCall, Turn
from gyre.proxy.token_floor import bytes_per_token_bound, token_floor

SENTINEL = "GYRE_SENTINEL_5f0c9a"
TOOL_STUB = {"role": "tool", "content": "x", "tool_call_id": "x"}  # a message no template counts as a user query
USER_STUB = {"role": "user", "content": "x"}

# What rendering a chat template raises for a conversation it refuses: its own raise_exception (ValueError),
# Jinja errors, and the errors of Python operations the template applies to message fields.
_TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError)


class RenderError(Exception):
    """The template refused a message list (its own exception, a Jinja error, a type error)."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    # transformers' `tojson` (jinja2's own escapes <, >, & and ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):  # an AddedToken serialized as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (memcmp-based: startswith, then binary search on slices)."""
    if b.startswith(a):
        return len(a)
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if b.startswith(a[:mid]):
            low = mid
        else:
            high = mid - 1
    return low


def _arguments_value(arguments: str) -> Any:
    """A tool call's arguments as templates expect them: the parsed JSON object, else the text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _tool_call_message(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": _arguments_value(call.arguments)},
    }


def floor_chars(turns: Sequence[Turn]) -> int:
    """The characters of `turns` that a prompt floor counts: their user and tool texts, stripped."""
    return sum(len(turn.text.strip()) for turn in turns if turn.role in ("user", "tool"))


class ChatTemplate:
    """A tokenizer plus its Jinja chat template, rendered in transformers' sandboxed environment."""

    def __init__(
        self,
        tokenizer: Any,
        template: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_stop_ids: Sequence[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.tokenizer = tokenizer
        self.template = template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._compiled = env.from_string(template)
        self._context = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        stops: list[int] = []
        for text in (eos_token, "<|im_end|>"):
            token_id = tokenizer.token_to_id(text) if text else None
            if token_id is not None:
                stops.append(token_id)
        stops.extend(int(i) for i in extra_stop_ids)
        self.end_of_turn_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))  # stop ids for the engine
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), vocab_size or 0)
        self._stop_texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in self.end_of_turn_ids}
        self.bytes_per_token = bytes_per_token_bound(tokenizer)  # None: no floor without encoding (token_floor.py)
        self._probe()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ChatTemplate:
        """Load `tokenizer.json` and the chat template of an HF-layout directory (no network)."""
        from tokenizers import Tokenizer

        root = Path(model_dir)
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
            template = named.get("default")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        if not isinstance(template, str):
            raise ValueError(f"{root}: no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
        extra_stops: list[int] = []
        vocab_size = None
        for name in ("generation_config.json", "config.json"):
            path = root / name
            if path.is_file():
                data = json.loads(path.read_text(encoding="utf-8"))
                eos = data.get("eos_token_id")
                extra_stops.extend(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
                if name == "config.json" and isinstance(data.get("vocab_size"), int):
                    vocab_size = data["vocab_size"]
        return cls(
            Tokenizer.from_file(str(root / "tokenizer.json")),
            template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            extra_stop_ids=extra_stops,
            vocab_size=vocab_size,
        )

    # -- rendering and encoding -------------------------------------------------------------------
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        enable_thinking: bool | None = None,
    ) -> str:
        """The template's text. `enable_thinking` is passed to the template only when not None (Qwen3's variable:
        False makes its generation prompt close an empty thinking block); None renders the template's default."""
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            return self._compiled.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **self._context,
                **extra,
            )
        except _TEMPLATE_ERRORS as err:
            raise RenderError(f"the chat template refused the conversation: {err}") from err

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens it contains map to their single ids, nothing is added.

        Through `encode_batch_fast`: the same ids as `encode`, without offsets (~17% less CPU on a harness's
        1.2K-token tool result), and the GIL released while it tokenizes (`encode` holds it), so a big text on a
        worker thread leaves the event loop free (`gyre.proxy.server`, big prompts) and no text holds up the
        controller's thread beside the proxy."""
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each of `texts` (as `encode`), in one `encode_batch_fast`: the GIL released throughout."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` can encode to, without encoding it (0 if the tokenizer gives no floor)."""
        return token_floor(len(text), self.bytes_per_token)

    def message(self, turn: Turn, *, first: bool = False) -> dict[str, Any]:
        """The HF message dict of a turn (`first`: a leading system turn keeps the system role)."""
        if turn.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": turn.text}
            if turn.thinking:
                message["reasoning_content"] = turn.thinking
            if turn.tool_calls:
                message["tool_calls"] = [_tool_call_message(call) for call in turn.tool_calls]
            return message
        if turn.role == "tool":
            return {"role": "tool", "content": turn.text, "tool_call_id": turn.tool_call_id}
        if turn.role == "system" and not first:
            return {"role": self.mid_system_role, "content": turn.text}
        return {"role": turn.role, "content": turn.text}

    def messages(self, request: ChatRequest) -> list[dict[str, Any]]:
        """All HF messages of a request: the system prompt first, then one per turn."""
        head = [{"role": "system", "content": request.system}] if request.system is not None else []
        leading = request.system is None
        return head + [self.message(turn, first=leading and i == 0) for i, turn in enumerate(request.turns)]

    def render_request(
        self, request: ChatRequest, *, add_generation_prompt: bool = True, enable_thinking: bool | None = None
    ) -> str:
        """The whole conversation rendered in one piece (the reference the segments are tested against)."""
        tools = [tool.as_template_tool() for tool in request.tools]
        return self.render(
            self.messages(request), tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
        )

    def generation_suffix(self, enable_thinking: bool | None) -> str:
        """What the template appends to `generation_prompt` when rendered with `enable_thinking` (probed): Qwen3's
        `<think>\n\n</think>\n\n` for False, "" for None and for templates that ignore the variable."""
        if enable_thinking is None:
            return ""
        suffix = self._generation_suffixes[enable_thinking]
        if suffix is None:
            raise ValueError(self.thinking_switch_problem(enable_thinking))
        return suffix

    def thinking_switch_problem(self, enable_thinking: bool) -> str | None:
        """Why this template cannot be rendered with `enable_thinking` (None: it can): the variable must change
        nothing but the end of the generation prompt, or earlier turns would render differently per call."""
        if self._generation_suffixes[enable_thinking] is not None:
            return None
        return (
            f"the chat template rendered with enable_thinking={enable_thinking} changes more than the end of the "
            "generation prompt, so gyre cannot keep earlier turns' tokens; leave proxy.thinking=template"
        )

    def output_starts_in_thinking(self, enable_thinking: bool | None) -> bool:
        """Does the generation prompt leave a `<think>` block open, so the output starts inside the thinking?"""
        text = self.generation_prompt + self.generation_suffix(enable_thinking)
        return text.rfind("<think>") > text.rfind("</think>")

    # -- template facts, probed once -------------------------------------------------------------
    def _probe(self) -> None:
        user = [{"role": "user", "content": "u"}]
        closed = self.render(user)
        self.generation_prompt = self.render(user, add_generation_prompt=True)[len(closed) :]
        if not self.generation_prompt:
            raise ValueError("the chat template adds no generation prompt (add_generation_prompt=True changes nothing)")
        self._generation_suffixes = {flag: self._probe_generation_suffix(user, flag) for flag in (True, False)}
        answered = self.render([*user, {"role": "assistant", "content": SENTINEL}])
        at = answered.find(SENTINEL, len(closed))
        # Text after an assistant's content; "" disables splitting assistant turns (whole-conversation renders).
        self.assistant_footer = answered[at + len(SENTINEL) :] if at >= 0 else ""
        try:
            followed = self.render([*user, {"role": "assistant", "content": SENTINEL}, TOOL_STUB])
        except RenderError:
            followed = answered
        # Does the template render a conversation's last assistant message differently (Qwen3: an empty thinking
        # block before it)? Then a render ending with an assistant message does not show how it reads mid-way.
        self.last_assistant_differs = not followed.startswith(answered)
        self.footer_stop_text = max(
            (text for text in self._stop_texts.values() if text and self.assistant_footer.startswith(text)),
            key=len,
            default="",
        )
        try:
            mid = self.render([*user, {"role": "system", "content": SENTINEL}])
        except RenderError:
            mid = ""
        self.mid_system_role = "system" if SENTINEL in mid else "user"
        self.keeps_contents = self._keeps_contents()

    def _probe_generation_suffix(self, user: list[dict[str, Any]], enable_thinking: bool) -> str | None:
        closed = self.render(user, enable_thinking=enable_thinking)
        prompt = self.render(user, add_generation_prompt=True, enable_thinking=enable_thinking)[len(closed) :]
        if closed != self.render(user) or not prompt.startswith(self.generation_prompt):
            return None  # it changes more than the generation prompt's end: the builder cannot keep its segments
        return prompt[len(self.generation_prompt) :]

    def _keeps_contents(self) -> bool:
        """Does the template render every user and tool message's content, at most trimmed? (`prompt_floor`)"""
        call = ToolCall(id="c1", name="f", arguments="{}")
        turns = [
            Turn(role="user", text=" GYRE_PROBE_U1 "),
            Turn(role="assistant", text="a", tool_calls=(call,)),
            Turn(role="tool", text=" GYRE_PROBE_T1 ", tool_call_id="c1"),
            Turn(role="user", text=" GYRE_PROBE_U2 "),
        ]
        try:
            rendered = self.render([self.message(turn) for turn in turns], add_generation_prompt=True)
        except RenderError:
            return False
        return all(rendered.count(marker) == 1 for marker in ("GYRE_PROBE_U1", "GYRE_PROBE_T1", "GYRE_PROBE_U2"))

    def prompt_floor(self, turns: Sequence[Turn]) -> int:
        """The fewest tokens a prompt holding `turns` (any of its turns) can have, from their user and tool texts
        alone (which the template renders, at most trimmed: probed), without rendering or encoding anything. 0
        when that is not known."""
        return self.floor_of_chars(floor_chars(turns))

    def floor_of_chars(self, chars: int) -> int:
        """`prompt_floor` of turns whose `floor_chars` is `chars`."""
        if not self.bytes_per_token or not self.keeps_contents:
            return 0
        return token_floor(chars, self.bytes_per_token)

    def glue_after(self, output_ids: Sequence[int]) -> str:
        """Template text between our output ids and the next message: the footer minus the stop token we emitted."""
        stop_text = self._stop_texts.get(output_ids[-1]) if len(output_ids) else None
        if stop_text and self.assistant_footer.startswith(stop_text):
            return self.assistant_footer[len(stop_text) :]
        return self.assistant_footer
