"""Evaluators inside the execution's sandbox: `SandboxHost`, the `gyre.tasks.evaluate.EvaluatorHost` for it.

A command evaluator such as pytest imports and runs the agent's code, so where it runs matters as much as where
the harness ran. `SandboxHost(sandbox, execution_id)` prepares a separate execution of the same sandbox,
`<execution_id>.evaluate`, whose home is the evaluation's directory: `evaluate` copies the preserved workspace
and the hidden files below it, and the evaluator process is started with `sandbox.start` like a harness:

- `LocalSandbox` as root (own uid per execution): the evaluator runs as a uid of its own (allocated round robin,
  so not the uid the harness just released), which owns only the copy; the run directory (`protected_paths`),
  other executions' workspaces and the controller's files stay closed to it, and `release` kills every process of
  that uid afterwards (also a daemon in a session of its own). Its interpreter must be reachable by other users:
  an absolute `argv[0]` that is not is refused at the start (`EvaluatorStartError`: a FAILED attempt, with why).
- `BubblewrapSandbox` / `ContainerSandbox`: their filesystem view, plus `ro_paths` bound read-only: for
  `run_episode`, `evaluator_read_paths` (the controller's Python: `sys.prefix`, `sys.base_prefix`, the existing
  directories of `sys.path`, the gyre package; and the task's directory), which `{python}` and python evaluators
  need.
- `LocalSandbox(isolate_user=False)`: its own session, rlimits and the scrubbed environment; no file isolation.

The environment stays the evaluator's own (PATH and locale, the task's `env`), plus HOME and TMPDIR below the
evaluation's directory. Output goes to files in the evaluation's private log directory. `run` is called once;
`close` releases the evaluation (if `run` did not) and removes its directories. Both block: call them from a
worker thread (`run_episode` does), never on a running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

import gyre
from gyre.harness.protocol import ExecutionContext, LaunchSpec
from gyre.harness.sandbox import Sandbox, SandboxError, chown_tree
from gyre.tasks.evaluate import EvaluatorStartError

__all__ = ["SandboxHost", "evaluator_read_paths"]

EVALUATION_SUFFIX = ".evaluate"


class SandboxHost:
    """One evaluation of `execution_id`'s work inside `sandbox` (see the module docstring); close it after use."""

    def __init__(self, sandbox: Sandbox, execution_id: str, *, ro_paths: Iterable[Path] = ()) -> None:
        self.sandbox = sandbox
        self.evaluation_id = execution_id + EVALUATION_SUFFIX
        self.ro_paths = _outside_private_paths(sandbox, ro_paths)
        self._dirs = sandbox.prepare(self.evaluation_id)
        self.directory = self._dirs.home  # bound read-write by every sandbox; TMPDIR (home/tmp) lies below it

    def _context(self, workspace: Path) -> ExecutionContext:
        return ExecutionContext(
            execution_id=self.evaluation_id,
            task_prompt="",
            workspace=workspace,  # below `directory`: the sandbox starts (and bwrap chdirs) here
            home=self.directory,
            log_dir=self._dirs.log_dir,
            anthropic_base_url="",
            openai_base_url="",
            api_key="",
            model="",
        )

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str]:
        context = self._context(cwd)
        uid = self.sandbox.uid_of(self.evaluation_id)
        if uid is not None:  # evaluate copied the work in as the controller: hand it to the evaluation's uid
            chown_tree(self.directory, uid, uid)
        env = {**env, "HOME": str(self.directory), "TMPDIR": str(self._dirs.tmp)}
        spec = LaunchSpec(argv=tuple(argv), env=env, ro_paths=self.ro_paths)
        try:
            code = asyncio.run(self._start_and_wait(spec, context, timeout_s))
        except SandboxError as error:
            raise EvaluatorStartError(str(error)) from None
        finally:
            self.sandbox.release(context)  # every process of the evaluation's uid killed; the copy is ours again
        return code, _read(self._dirs.log_dir / "stdout.txt"), _read(self._dirs.log_dir / "stderr.txt")

    async def _start_and_wait(self, spec: LaunchSpec, context: ExecutionContext, timeout_s: float) -> int | None:
        with (
            open(self._dirs.log_dir / "stdout.txt", "wb") as stdout,
            open(self._dirs.log_dir / "stderr.txt", "wb") as stderr,
        ):
            process = await self.sandbox.start(spec, context, stdout=stdout.fileno(), stderr=stderr.fileno())
            try:
                code: int | None = await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                code = None
            with contextlib.suppress(ProcessLookupError):  # its own session: the whole group goes
                os.killpg(process.pid, signal.SIGKILL)
            if code is None:
                await process.wait()
            return code

    def close(self) -> None:
        try:
            self.sandbox.release(self._context(self.directory))  # when `run` never ran: the uid goes back
        finally:
            shutil.rmtree(self._dirs.root, ignore_errors=True)


def evaluator_read_paths(task_dir: Path | None = None) -> tuple[Path, ...]:
    """What an evaluator started with the controller's Python reads: `sys.prefix`, `sys.base_prefix`, the
    existing absolute directories of `sys.path`, the gyre package's directory, and `task_dir`."""
    candidates = [Path(sys.prefix), Path(sys.base_prefix), Path(gyre.__file__).resolve().parent]
    candidates += [Path(p) for p in sys.path if p and os.path.isabs(p)]
    if task_dir is not None:
        candidates.append(Path(task_dir))
    paths: list[Path] = []
    for path in candidates:
        if path.is_dir() and path not in paths:
            paths.append(path)
    return tuple(paths)


def _outside_private_paths(sandbox: Sandbox, paths: Iterable[Path]) -> tuple[Path, ...]:
    """`paths` without those that would bind the sandbox's executions or a protected path (the run directory)
    into the evaluation: a path equal to, above or below one of them (e.g. a repository checkout on `sys.path`
    that holds Hydra's `outputs/`)."""
    private = [*getattr(sandbox, "protected_paths", ())]
    if getattr(sandbox, "root", None) is not None:
        private.append(sandbox.root)
    private = [Path(p).resolve() for p in private]
    kept = []
    for path in paths:
        resolved = Path(path).resolve()
        if not any(p.is_relative_to(resolved) or resolved.is_relative_to(p) for p in private):
            kept.append(Path(path))
    return tuple(kept)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
