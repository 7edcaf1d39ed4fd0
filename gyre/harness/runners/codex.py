"""The `codex` runner: Codex CLI's `exec` mode against the proxy's OpenAI Responses API, offline.

As docs/harness.md records (Codex 0.171.0, Responses API only): a provider in `$CODEX_HOME/config.toml`
(`wire_api = "responses"`, the key read from the env var `env_key` names), then `codex exec --skip-git-repo-check
-c analytics.enabled=false -c check_for_update_on_startup=false --disable plugins
--dangerously-bypass-approvals-and-sandbox -` with the task on standard input (not argv: no length limit, not shown
by `ps`). Those switches remove all other outbound traffic, and the bypass leaves sandboxing to gyre's (Codex's
default, read-only, would keep the agent from changing the workspace). CODEX_HOME is `<home>/.codex`, private to
the execution; it holds the config written per execution (`config.toml`: the served model name, then `settings`,
the user's TOML, then the proxy as the only provider) and `instructions` as `AGENTS.md` (Codex's global
instructions, so the workspace stays as the task made it). `codex` is a node script: node must be installed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gyre.harness.protocol import ExecutionContext, HarnessNotFoundError, LaunchSpec
from gyre.harness.runners.claude_code import find_cli
from gyre.harness.runners.command import DEFAULT_PATH, harness_environment

__all__ = ["CODEX_PACKAGE", "CODEX_VERSION", "CodexRunner", "codex_config_toml"]

CODEX_PACKAGE = "@openai/codex"
CODEX_VERSION = "0.171.0"  # the version observed (docs/harness.md, "What the harnesses send")
PROVIDER = "gyre"
KEY_ENV = "GYRE_API_KEY"  # the provider's env_key: Codex reads the execution's key from here


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def codex_config_toml(*, model: str, base_url: str, settings: str = "") -> str:
    """Codex's config.toml: the served model and the proxy as the only model provider, on the Responses wire API.
    `settings` (the user's TOML: top-level keys and tables) goes between gyre's top-level keys and the provider's
    table, so both stay what they are; a key of gyre's set again there makes the file invalid (checked at start,
    `gyre.runtime.job.harness_setup.harness_provisioning`)."""
    user = settings.strip("\n") + "\n\n" if settings.strip() else ""
    return (
        f"model = {_toml_str(model)}\n"
        f"model_provider = {_toml_str(PROVIDER)}\n"
        "\n"
        f"{user}"
        f"[model_providers.{PROVIDER}]\n"
        f"name = {_toml_str(PROVIDER)}\n"
        f"base_url = {_toml_str(base_url)}\n"
        f"env_key = {_toml_str(KEY_ENV)}\n"
        'wire_api = "responses"\n'
    )


@dataclass(kw_only=True)
class CodexRunner:
    name: str = "codex"  # also the role classifier
    binary: str | None = None  # path or name of `codex`; None: PATH, then the npm test cache
    node: str | None = None  # the node executable; None: found on PATH
    extra_args: Sequence[str] = ()  # inserted before the task (e.g. "-c", "model_reasoning_effort=low")
    env: Mapping[str, str] = field(default_factory=dict)
    path: str = DEFAULT_PATH
    instructions: str = ""  # written as $CODEX_HOME/AGENTS.md ("": none)
    settings: str = ""  # TOML lines added to config.toml ("": none)

    def _executable(self) -> str | None:
        return find_cli(self.binary, "codex", CODEX_PACKAGE, CODEX_VERSION)

    def _node(self) -> str | None:
        return self.node or shutil.which("node")

    def check(self) -> None:
        if self._executable() is None:
            where = f"binary {self.binary!r} is not an executable" if self.binary else "`codex` is not on PATH"
            raise HarnessNotFoundError(
                f"Codex (codex runner): {where}; install it with `npm install -g {CODEX_PACKAGE}@{CODEX_VERSION}` "
                "or pass binary=<path to codex>"
            )
        if self._node() is None:
            raise HarnessNotFoundError(
                "Codex (codex runner): `node` not found; install Node.js 18+ (codex is a node script)"
            )

    def launch_spec(self, context: ExecutionContext) -> LaunchSpec:
        self.check()
        executable, node = self._executable(), self._node()
        assert executable is not None and node is not None
        codex_home = context.home / ".codex"
        dirs = [os.path.dirname(executable), os.path.dirname(node)]
        env = harness_environment(context, path_dirs=dirs, path=self.path)
        env.update({"CODEX_HOME": str(codex_home), KEY_ENV: context.api_key})
        env.update(self.env)
        argv = (
            executable,
            "exec",
            "--skip-git-repo-check",
            "-c",
            "analytics.enabled=false",
            "-c",
            "check_for_update_on_startup=false",
            "--disable",
            "plugins",
            # gyre's sandbox is the execution's (own uid or bubblewrap): Codex's own would leave the workspace
            # read-only (`codex exec`'s default), so the agent could not change what gets scored.
            "--dangerously-bypass-approvals-and-sandbox",
            *self.extra_args,
            "-",  # the task on standard input
        )
        config = codex_config_toml(model=context.model, base_url=context.openai_base_url, settings=self.settings)
        files = {codex_home / "config.toml": config}
        if self.instructions:
            files[codex_home / "AGENTS.md"] = self.instructions
        return LaunchSpec(argv=argv, env=env, files=files, stdin=context.task_prompt)
