"""Evaluators inside the execution's sandbox: `SandboxHost`, the `gyre.tasks.evaluate.EvaluatorHost` for it.

A command evaluator such as pytest imports and runs the agent's code, so where it runs matters as much as where
the harness ran. `SandboxHost(sandbox, execution_id)` prepares a separate execution of the same sandbox,
`<execution_id>.evaluate`, whose home is the evaluation's directory: `evaluate` copies the preserved workspace
and the hidden files below it, and the evaluator process is started with `sandbox.start` like a harness:

- `LocalSandbox` as root (own uid per execution): the evaluator runs as a uid of its own, which owns only the
  copy; the run directory (`protected_paths`), other executions' workspaces and the controller's files stay
  closed to it, and `release` kills every process of that uid afterwards (also a daemon in a session of its own).
  Its interpreter must be reachable by other users (`SandboxError` otherwise: an attempt that FAILED, with why).
- `BubblewrapSandbox`: a mount namespace holding the system directories, the interpreter's install prefix,
  `ro_binds` and the evaluation's directory only.
- `LocalSandbox(isolate_user=False)`: its own session and the scrubbed environment; no file isolation.

The environment stays the evaluator's own (PATH and locale, the task's `env`), plus HOME and TMPDIR below the
evaluation's directory. Output goes to files in the evaluation's private log directory. `close` releases the
evaluation and removes its directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from pathlib import Path

from gyre.harness.protocol import ExecutionContext, LaunchSpec
from gyre.harness.sandbox import LocalSandbox, Sandbox, SandboxError, chown_tree
from gyre.tasks.evaluate import EvaluatorStartError

__all__ = ["SandboxHost"]

EVALUATION_SUFFIX = ".evaluate"


class SandboxHost:
    """One evaluation of `execution_id`'s work inside `sandbox` (see the module docstring); close it after use."""

    def __init__(self, sandbox: Sandbox, execution_id: str) -> None:
        self.sandbox = sandbox
        self.evaluation_id = execution_id + EVALUATION_SUFFIX
        self._dirs = sandbox.prepare(self.evaluation_id)
        self.directory = self._dirs.home  # bound read-write by every sandbox; TMPDIR (home/tmp) lies below it

    def _uid(self) -> int | None:
        return self.sandbox.uid_of(self.evaluation_id) if isinstance(self.sandbox, LocalSandbox) else None

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str]:
        context = ExecutionContext(
            execution_id=self.evaluation_id,
            task_prompt="",
            workspace=cwd,  # below `directory`: the sandbox starts (and bwrap chdirs) here
            home=self.directory,
            log_dir=self._dirs.log_dir,
            anthropic_base_url="",
            openai_base_url="",
            api_key="",
            model="",
        )
        uid = self._uid()
        if uid is not None:  # evaluate copied the work in as the controller: hand it to the evaluation's uid
            chown_tree(self.directory, uid, uid)
        env = {**env, "HOME": str(self.directory), "TMPDIR": str(self._dirs.tmp)}
        stdout_path, stderr_path = self._dirs.log_dir / "stdout.txt", self._dirs.log_dir / "stderr.txt"
        try:
            code = asyncio.run(self._start_and_wait(LaunchSpec(argv=tuple(argv), env=env), context, timeout_s))
        except SandboxError as error:
            raise EvaluatorStartError(str(error)) from None
        finally:
            self.sandbox.release(context)  # every process of the evaluation's uid killed; the copy is ours again
        return code, _read(stdout_path), _read(stderr_path)

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
        shutil.rmtree(self._dirs.root, ignore_errors=True)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
