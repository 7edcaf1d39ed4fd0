"""The `claude_code` runner: Claude Code's CLI in print mode against the proxy's Anthropic Messages API, offline.

As docs/harness.md records (Claude Code 2.1.197): `claude -p --dangerously-skip-permissions` with the task on
standard input (not argv: no length limit, not shown by `ps`), ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY, IS_SANDBOX=1
(as root it refuses the flag without it) and CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 (no telemetry, update checks
or title request: the proxy is the only peer). Every model the CLI may ask for (main, small/fast, sub-agent) is set
to the served model name.
Provisioning, per execution under its private HOME: `instructions` become the user memory `~/.claude/CLAUDE.md`
(read as project instructions, the workspace left as the task made it), `settings` (a JSON object's text) the user
settings `~/.claude/settings.json`.

The binary: `binary=` if given; else `claude` on the controller's PATH; else the npm install the tests make
(`$GYRE_TEST_CLI_CACHE` or ~/.cache/gyre-test-clis, `@anthropic-ai__claude-code@<version>`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gyre.harness.protocol import ExecutionContext, HarnessNotFoundError, LaunchSpec
from gyre.harness.runners.command import DEFAULT_PATH, harness_environment, resolve_executable

__all__ = ["CLAUDE_CODE_PACKAGE", "CLAUDE_CODE_VERSION", "ClaudeCodeRunner", "npm_cache_executable"]

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.197"  # the version observed (docs/harness.md, "What the harnesses send")


def npm_cache_executable(package: str, version: str, bin_name: str) -> Path:
    """Where tests/integration/test_harness_clis.py installs an npm CLI (it may not exist)."""
    env = os.environ.get("GYRE_TEST_CLI_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "gyre-test-clis"
    return root / f"{package.replace('/', '__')}@{version}" / "node_modules" / ".bin" / bin_name


def find_cli(binary: str | None, bin_name: str, package: str, version: str) -> str | None:
    """The CLI's absolute path: `binary`, else `bin_name` on the controller's PATH, else the npm test cache."""
    if binary is not None:
        return resolve_executable(binary, os.environ.get("PATH", os.defpath))
    found = resolve_executable(bin_name, os.environ.get("PATH", os.defpath))
    if found is not None:
        return found
    cached = npm_cache_executable(package, version, bin_name)
    return str(cached) if os.access(cached, os.X_OK) else None


@dataclass(kw_only=True)
class ClaudeCodeRunner:
    name: str = "claude_code"  # also the role classifier
    binary: str | None = None  # path or name of `claude`; None: PATH, then the npm test cache
    extra_args: Sequence[str] = ()  # appended after the standard flags (e.g. "--max-turns", "50")
    env: Mapping[str, str] = field(default_factory=dict)  # fixed additions
    path: str = DEFAULT_PATH
    instructions: str = ""  # written as ~/.claude/CLAUDE.md ("": none)
    settings: str = ""  # a JSON object, written as ~/.claude/settings.json ("": none)

    def _executable(self) -> str | None:
        return find_cli(self.binary, "claude", CLAUDE_CODE_PACKAGE, CLAUDE_CODE_VERSION)

    def check(self) -> None:
        if self._executable() is None:
            where = f"binary {self.binary!r} is not an executable" if self.binary else "`claude` is not on PATH"
            raise HarnessNotFoundError(
                f"Claude Code (claude_code runner): {where}; install it with "
                f"`npm install -g {CLAUDE_CODE_PACKAGE}@{CLAUDE_CODE_VERSION}` or pass binary=<path to claude>"
            )

    def launch_spec(self, context: ExecutionContext) -> LaunchSpec:
        executable = self._executable()
        if executable is None:
            self.check()
        assert executable is not None
        env = harness_environment(context, path_dirs=[os.path.dirname(executable)], path=self.path)
        env.update(
            {
                "IS_SANDBOX": "1",  # as root, --dangerously-skip-permissions is refused without it
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # the proxy is the only peer
                "ANTHROPIC_MODEL": context.model,
                "ANTHROPIC_SMALL_FAST_MODEL": context.model,
                "CLAUDE_CODE_SUBAGENT_MODEL": context.model,
            }
        )
        env.update(self.env)
        argv = (executable, "-p", "--dangerously-skip-permissions", *self.extra_args)
        files = {}
        if self.instructions:
            files[context.home / ".claude" / "CLAUDE.md"] = self.instructions
        if self.settings:
            files[context.home / ".claude" / "settings.json"] = self.settings
        return LaunchSpec(argv=argv, env=env, files=files, stdin=context.task_prompt)
