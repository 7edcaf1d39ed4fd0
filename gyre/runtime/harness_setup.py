"""The configured harness and sandbox of a training run (`HarnessConfig`, docs/configuration.md; the runners and
sandboxes themselves: docs/harness.md).

- `make_runner(harness, task)`: the runner of one execution. `builtin` is configured from the task's metadata
  (`BuiltinRunner.for_task`: the demo family's calculator tool, system prompt and answer file), with the config's
  backend, turn budget and extra flags; `command`, `claude_code` and `codex` take the config's argv, binary, extra
  flags and environment as they are.
- `make_sandbox(harness, limits, root=, protected=)`: where the executions run, under `root` (the run directory's
  `executions/`): plain processes (`local`: an own uid per execution when the controller runs as root),
  bubblewrap, or a container; the run's records directory is made private to the harnesses. `isolate_user`
  resolves `harness.isolate_user`'s null (auto).
- `check_harness(runner, sandbox)`: the runner's binary or SDK and the sandbox are usable, checked once at start so
  a missing CLI or bwrap is one line before any execution starts (`HarnessSetupError`).
"""

from __future__ import annotations

from pathlib import Path

from gyre.config.harness import ExecutionLimits, HarnessConfig
from gyre.harness.sandbox import BubblewrapSandbox, ContainerSandbox, LocalSandbox, unreachable_by_others

__all__ = ["HarnessSetupError", "check_harness", "isolate_user", "make_runner", "make_sandbox"]


class HarnessSetupError(RuntimeError):
    """The configured harness or sandbox cannot run here (one line naming what is missing)."""


def make_runner(harness: HarnessConfig, task):
    """The runner of one execution of `task` (module docstring)."""
    from gyre.harness.builtin.runner import BuiltinRunner
    from gyre.harness.runners import runner_for

    if harness.name == "builtin":
        return BuiltinRunner.for_task(
            task, backend=harness.backend, max_turns=harness.max_turns, extra_args=tuple(harness.extra_args)
        )
    if harness.name == "command":
        return runner_for("command", argv=tuple(harness.argv), env=dict(harness.env))
    return runner_for(
        harness.name, binary=harness.binary or None, extra_args=tuple(harness.extra_args), env=dict(harness.env)
    )


def isolate_user(harness: HarnessConfig, *, demo_tasks: bool) -> bool | None:
    """`harness.isolate_user`, with null resolved: no own uid for the builtin harness on the bundled demo family (its
    agent has only the calculator tool), else LocalSandbox's rule (None: an own uid exactly when root)."""
    if harness.isolate_user is not None:
        return harness.isolate_user
    return False if harness.name == "builtin" and demo_tasks else None


def make_sandbox(
    harness: HarnessConfig,
    limits: ExecutionLimits,
    *,
    root: Path,
    demo_tasks: bool,
    protected: tuple[Path, ...] = (),
):
    """The executions' sandbox under `root` (module docstring)."""
    common = {"root": root, "limits": limits.resources, "protected_paths": protected}
    if harness.sandbox == "bubblewrap":
        return BubblewrapSandbox(**common)
    if harness.sandbox == "container":
        return ContainerSandbox(**common, engine=harness.container_engine, image=harness.container_image)
    return LocalSandbox(**common, isolate_user=isolate_user(harness, demo_tasks=demo_tasks))


def check_harness(runner, sandbox) -> None:
    """The runner and the sandbox can start executions here; HarnessSetupError naming what is missing (and, for an
    own uid per execution, an interpreter closed to other users, which every execution would fail on)."""
    interpreter = getattr(runner, "python", None)  # the builtin harness's
    if getattr(sandbox, "isolate_user", False) and interpreter and sandbox.name == "local":
        closed = unreachable_by_others(interpreter)
        if closed is not None:
            raise HarnessSetupError(
                f"harness.isolate_user: each execution runs under its own uid, which cannot run {interpreter} "
                f"({closed} is closed to other users); install gyre where all users may read it, or set "
                "harness.isolate_user=false (or harness.sandbox=bubblewrap)"
            )
    for part, what in ((runner, f"harness {getattr(runner, 'name', '?')}"), (sandbox, f"sandbox {sandbox.name}")):
        check = getattr(part, "check", None)
        if check is None:
            continue
        try:
            check()
        except Exception as error:  # each part raises its own kind (not found, not permitted, ...)
            raise HarnessSetupError(f"{what}: {error}") from None
