"""Harness runners (`gyre.harness.protocol.HarnessRunner`) and their registry.

`runner_for(name, **options)` builds one: `builtin` (gyre's reference harness, `python -m gyre.harness.builtin`),
`command` (any agent on the OpenAI/Anthropic SDKs, argv template), `claude_code` (Claude Code CLI) or `codex`
(Codex CLI). See docs/harness.md ("How to add a runner").
"""

from __future__ import annotations

from collections.abc import Callable

from gyre.harness.protocol import HarnessRunner
from gyre.harness.runners.claude_code import ClaudeCodeRunner
from gyre.harness.runners.codex import CodexRunner
from gyre.harness.runners.command import CommandRunner, harness_environment


def _builtin(**options: object) -> HarnessRunner:
    # imported here: gyre.harness.builtin.runner imports gyre.harness.runners.command (no import cycle)
    from gyre.harness.builtin.runner import BuiltinRunner

    return BuiltinRunner(**options)


__all__ = [
    "RUNNERS",
    "ClaudeCodeRunner",
    "CodexRunner",
    "CommandRunner",
    "harness_environment",
    "runner_for",
]

RUNNERS: dict[str, Callable[..., HarnessRunner]] = {
    "builtin": _builtin,
    "command": CommandRunner,
    "claude_code": ClaudeCodeRunner,
    "codex": CodexRunner,
}


def runner_for(name: str, **options: object) -> HarnessRunner:
    """The runner registered as `name`, built with `options` (its dataclass fields)."""
    try:
        factory = RUNNERS[name]
    except KeyError:
        raise ValueError(f"unknown harness runner {name!r}; known runners: {', '.join(sorted(RUNNERS))}") from None
    try:
        return factory(**options)
    except TypeError as exc:
        raise ValueError(f"harness runner {name!r}: bad options {sorted(options)}: {exc}") from None
