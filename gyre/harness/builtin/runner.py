"""`BuiltinRunner`: starts gyre's builtin harness (`python -m gyre.harness.builtin`) for one execution.

Implements `gyre.harness.protocol.HarnessRunner`. The task goes into a file (`<home>/task.md`, written by the
launcher before the start) rather than argv, so a long prompt never meets the kernel's argument limits. The
environment is complete: `gyre.harness.runners.command.harness_environment` (PATH, HOME, locale, NO_PROXY, the
proxy's base URLs and the execution's key for both SDKs, GYRE_MODEL, the context's `extra_env`) plus PYTHONPATH,
so the harness imports the same `gyre`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gyre
from gyre.harness.protocol import ExecutionContext, HarnessNotFoundError, LaunchSpec
from gyre.harness.runners.command import harness_environment

TASK_FILE = "task.md"


@dataclass(kw_only=True)
class BuiltinRunner:
    name: str = "builtin"  # also the role classifier (`classifier_for("builtin")`)
    backend: str = "anthropic"  # anthropic | openai
    max_turns: int = 30
    extra_args: Sequence[str] = field(default_factory=tuple)  # more flags of `python -m gyre.harness.builtin`
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.backend not in ("anthropic", "openai"):
            raise ValueError(f"backend: got {self.backend!r}, expected 'anthropic' or 'openai'")

    def check(self) -> None:
        if importlib.util.find_spec(self.backend) is None:
            raise HarnessNotFoundError(
                f"the builtin harness needs the {self.backend!r} SDK: pip install {self.backend}"
            )

    def launch_spec(self, context: ExecutionContext) -> LaunchSpec:
        task_file = context.home / TASK_FILE
        argv = (
            self.python, "-m", "gyre.harness.builtin",
            "--task-file", str(task_file),
            "--backend", self.backend,
            "--model", context.model,
            "--workspace", str(context.workspace),
            "--log-dir", str(context.log_dir),
            "--max-turns", str(self.max_turns),
            *self.extra_args,
        )  # fmt: skip
        env = harness_environment(context)  # PATH, HOME, LANG, NO_PROXY, both SDKs' URL and key, extra_env
        ours = {"PYTHONPATH": str(Path(gyre.__file__).resolve().parent.parent), "PYTHONUNBUFFERED": "1"}
        env.update({k: v for k, v in ours.items() if k not in context.extra_env})
        return LaunchSpec(argv=argv, env=env, files={task_file: context.task_prompt})
