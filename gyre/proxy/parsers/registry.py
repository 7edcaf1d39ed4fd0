"""Parser names -> factories: `proxy.tool_call_parser` and `proxy.reasoning_parser` select from these.

The names are SGLang's (`--tool-call-parser`, `--reasoning-parser`), so one setting reads the same for both engines.
`gyre.config.proxy` checks a configured name against its own copy of the names (the config imports nothing of the
proxy); a unit test keeps the two equal. An unknown name here is a ValueError listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from gyre.proxy.conversation import ToolSpec
from gyre.proxy.parsers.base import ReasoningParser, ToolCallParser
from gyre.proxy.parsers.hermes import HermesParser
from gyre.proxy.parsers.llama3 import Llama3Parser
from gyre.proxy.parsers.qwen3_coder import Qwen3CoderParser
from gyre.proxy.parsers.reasoning import THINK_CLOSE, THINK_OPEN, NoReasoning, ThinkTags

# name -> factory(tools of the request) -> a parser for one model call
TOOL_CALL_PARSERS: dict[str, Callable[[Sequence[ToolSpec]], ToolCallParser]] = {
    "hermes": partial(HermesParser, name="hermes"),
    "qwen25": partial(HermesParser, name="qwen25"),
    "qwen": partial(HermesParser, name="qwen"),
    "qwen3_coder": partial(Qwen3CoderParser, name="qwen3_coder"),
    "llama3": partial(Llama3Parser, name="llama3"),
}

# name -> factory(starts_in_thinking) -> a parser for one model call; `None` is "none"
REASONING_PARSERS: dict[str, Callable[[bool], ReasoningParser]] = {
    "qwen3": lambda starts_in_thinking: ThinkTags(starts_in_thinking=starts_in_thinking),
    "qwen3-thinking": lambda starts_in_thinking: ThinkTags(starts_in_thinking=True),
    "deepseek-r1": lambda starts_in_thinking: ThinkTags(starts_in_thinking=True),
    "none": lambda starts_in_thinking: NoReasoning(),
}


def _known(name: object, registry: dict, field: str) -> None:
    if not isinstance(name, str) or name not in registry:
        raise ValueError(f"{field}={name!r} is not a known parser: expected one of {', '.join(registry)}")


def build_tool_call_parser(name: str, tools: Sequence[ToolSpec] = ()) -> ToolCallParser:
    _known(name, TOOL_CALL_PARSERS, "tool_call_parser")
    return TOOL_CALL_PARSERS[name](tools)


def build_reasoning_parser(name: str | None, *, starts_in_thinking: bool = False) -> ReasoningParser:
    name = "none" if name is None else name
    _known(name, REASONING_PARSERS, "reasoning_parser")
    return REASONING_PARSERS[name](starts_in_thinking)


def prompt_opens_thinking(reasoning_parser: str | None, generation_prompt: str) -> bool:
    """Whether the end of the prompt (the template's generation prompt, and whatever follows it) leaves a `<think>`
    open, as Qwen3 thinking models' templates do, so the output starts inside thinking. Never with no reasoning
    parser."""
    if reasoning_parser in (None, "none"):
        return False
    return generation_prompt.rfind(THINK_OPEN) > generation_prompt.rfind(THINK_CLOSE)
