"""The `command` runner: any agent that reads the standard SDK variables, started from a user-given argv template.

The agent finds the proxy through OPENAI_BASE_URL / OPENAI_API_KEY and ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY
(what the official OpenAI and Anthropic SDKs read), and the model name in GYRE_MODEL. The argv template may use
`{prompt}`, `{workspace}`, `{home}`, `{log_dir}`, `{model}`, `{execution_id}`, `{openai_base_url}` and
`{anthropic_base_url}`; the key never goes on the command line (other users can read command lines).

Also home of `harness_environment`, the explicit environment every runner starts from: nothing of the
controller's environment is inherited (no secrets leak into a harness).
"""

from __future__ import annotations

import os
import shutil
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gyre.harness.protocol import ExecutionContext, HarnessNotFoundError, LaunchSpec

__all__ = ["DEFAULT_PATH", "TEMPLATE_FIELDS", "CommandRunner", "harness_environment"]

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
TEMPLATE_FIELDS = frozenset(
    {"prompt", "workspace", "home", "log_dir", "model", "execution_id", "openai_base_url", "anthropic_base_url"}
)
LOCAL_HOSTS = "127.0.0.1,localhost,::1"


def harness_environment(context: ExecutionContext, *, path_dirs: Sequence[str] = (), path: str = DEFAULT_PATH) -> dict:
    """The base environment of a harness: PATH (`path_dirs` first), HOME=context.home, LANG, the proxy's URLs and
    the execution's key for both SDK families, then `context.extra_env` (which may override any of them)."""
    dirs = [d for d in path_dirs if d]
    env = {
        "PATH": ":".join(dict.fromkeys([*dirs, *path.split(":")])),
        "HOME": str(context.home),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "NO_PROXY": LOCAL_HOSTS,  # the proxy is local: never route it through a forward proxy
        "no_proxy": LOCAL_HOSTS,
        "OPENAI_BASE_URL": context.openai_base_url,
        "OPENAI_API_KEY": context.api_key,
        "ANTHROPIC_BASE_URL": context.anthropic_base_url,
        "ANTHROPIC_API_KEY": context.api_key,
        "GYRE_MODEL": context.model,
        "GYRE_EXECUTION_ID": context.execution_id,
    }
    env.update(context.extra_env)
    return env


def resolve_executable(name: str, path: str) -> str | None:
    """An absolute, executable path for `name` (a path, or a name looked up on `path`)."""
    if os.sep in name:
        return os.path.abspath(name) if os.access(name, os.X_OK) and os.path.isfile(name) else None
    return shutil.which(name, path=path)


@dataclass(kw_only=True)
class CommandRunner:
    """Runs `argv` (a template) with the standard SDK environment; `name` picks the role classifier."""

    argv: Sequence[str]  # e.g. ("python", "my_agent.py", "{prompt}")
    name: str = "command"  # also the role classifier (gyre.traj.roles.classifier_for): unknown names get `generic`
    env: Mapping[str, str] = field(default_factory=dict)  # fixed additions (not secrets of ours)
    path: str = DEFAULT_PATH  # PATH of the harness; argv[0] is looked up here and in the controller's PATH
    stdin: str | None = None  # text fed to stdin (a template like argv); None: /dev/null
    in_image: bool = False  # argv[0] is the container image's program (harness.container.harness_from_image): as given

    def __post_init__(self) -> None:
        self.argv = tuple(self.argv)
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"CommandRunner.argv must be a non-empty sequence of str, got {self.argv!r}")
        for item in (*self.argv, self.stdin or ""):
            for _, field_name, _, _ in string.Formatter().parse(item):
                if field_name is not None and field_name not in TEMPLATE_FIELDS:
                    raise ValueError(
                        f"CommandRunner.argv: unknown placeholder {{{field_name}}} in {item!r}; "
                        f"known: {', '.join(sorted(TEMPLATE_FIELDS))} (write {{{{ and }}}} for literal braces)"
                    )
        if "{" in self.argv[0]:
            raise ValueError(f"CommandRunner.argv[0] must be a fixed program, got {self.argv[0]!r}")

    def _executable(self) -> str | None:
        if self.in_image:  # found on the image's PATH when the container runs it; nothing of the host to look up
            return self.argv[0]
        return resolve_executable(self.argv[0], self.path) or resolve_executable(
            self.argv[0], os.environ.get("PATH", os.defpath)
        )

    def check(self) -> None:
        if self._executable() is None:
            raise HarnessNotFoundError(
                f"{self.name} runner: program {self.argv[0]!r} not found on PATH {self.path!r} or the controller's "
                "PATH; install it or give an absolute path in argv[0]"
            )

    def launch_spec(self, context: ExecutionContext) -> LaunchSpec:
        executable = self._executable()
        if executable is None:
            self.check()
        assert executable is not None
        values = {
            "prompt": context.task_prompt,
            "workspace": str(context.workspace),
            "home": str(context.home),
            "log_dir": str(context.log_dir),
            "model": context.model,
            "execution_id": context.execution_id,
            "openai_base_url": context.openai_base_url,
            "anthropic_base_url": context.anthropic_base_url,
        }
        argv = (executable, *(a.format_map(values) for a in self.argv[1:]))
        env = harness_environment(context, path_dirs=[os.path.dirname(executable)], path=self.path)
        env.update(self.env)
        stdin = self.stdin.format_map(values) if self.stdin is not None else None
        return LaunchSpec(argv=argv, env=env, stdin=stdin)
