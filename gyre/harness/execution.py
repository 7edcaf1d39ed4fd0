"""The lifecycle of one harness execution: start it in a sandbox, wait (bounded), stop it, say how it closed.

`run_harness(runner, sandbox, context, harness_timeout_s=..., cancel_event=...)` returns a `HarnessRun`:
- COMPLETED: the harness exited by itself (any exit code; the code is reported, the work is evaluated).
- HARNESS_TIMEOUT: its budget ran out; the whole process group got SIGTERM, then SIGKILL after
  `grace_period_s`. Its preserved work is still evaluated (partial scoring).
- CANCELLED: `cancel_event` was set (a surplus execution under oversampling); stopped the same way.
- FAILED: it could not start (runner.check failed: binary missing; the sandbox refused; exec failed), with the
  reason. No evaluable work: the group gets a zero-reward placeholder.
The workspace is always preserved; `sandbox.release` runs in every case (also when this coroutine is itself
cancelled, after a SIGKILL of the group). Every wait is bounded.

The overall budget (harness + evaluation) is the outcome's deadline, applied by `gyre.harness.episode`; evaluation
lives in `gyre.tasks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre.config.harness import DEFAULT_GRACE_PERIOD_S, DEFAULT_KILL_WAIT_S
from gyre.harness.protocol import ExecutionContext, HarnessNotFoundError, HarnessRunner
from gyre.harness.sandbox import Sandbox, SandboxError
from gyre.harness.threads import blocking
from gyre.traj.outcomes import CloseKind

__all__ = ["HarnessRun", "run_harness"]

logger = logging.getLogger(__name__)

STDIN_WRITE_TIMEOUT_S = 30.0
GROUP_POLL_S = 0.05  # how often a stopping process group is checked for members


@dataclass(frozen=True, kw_only=True)
class HarnessRun:
    """How one harness execution ended."""

    execution_id: str
    harness: str  # the runner's name (also its role classifier)
    close_kind: CloseKind
    exit_code: int | None  # the process's return code (negative: killed by that signal); None if never started
    duration_s: float  # from the call to the end of the process (or of the failed start)
    stdout_path: Path
    stderr_path: Path
    workspace: Path  # preserved in every case
    reason: str | None = None  # why it FAILED, or what stopped it (timeout, cancel)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is already gone
        os.killpg(pgid, sig)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # members that became another uid: still there
        return True
    return True


async def _wait_group(process: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait until the leader has exited and no member of its group is left (True), or `timeout_s` passed.

    The group, not just the leader: under bwrap the leader is bwrap itself, which dies at SIGTERM at once while
    the harness inside still runs its own shutdown. A zombie member counts as present (it shortens nothing but
    the wait: SIGKILL follows)."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if process.returncode is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), timeout=max(0.0, min(remaining, GROUP_POLL_S)))
        elif not _group_exists(process.pid):
            return True
        else:
            await asyncio.sleep(max(0.0, min(remaining, GROUP_POLL_S)))
        if remaining <= 0:
            return process.returncode is not None and not _group_exists(process.pid)


async def _stop_group(
    process: asyncio.subprocess.Process, grace_period_s: float, kill_wait_s: float, inside: Callable
) -> None:
    """SIGTERM the process group, SIGKILL it once the grace period has passed with any member left; bounded.
    `inside(grace_period_s)` first: the sandbox's `stop_inside` (a container's harness runs beyond the client's
    group, the client being `exec`; a no-op for the others)."""
    await inside(grace_period_s)
    pgid = process.pid  # the sandbox starts a new session: the leader's pid is the group id
    _signal_group(pgid, signal.SIGTERM)
    if await _wait_group(process, grace_period_s):
        return
    _signal_group(pgid, signal.SIGKILL)
    if not await _wait_group(process, kill_wait_s) and process.returncode is None:
        logger.error("harness process %d survived SIGKILL for %.1f s (uninterruptible?)", process.pid, kill_wait_s)


async def _feed_stdin(process: asyncio.subprocess.Process, text: str) -> None:
    assert process.stdin is not None
    try:
        process.stdin.write(text.encode())
        await asyncio.wait_for(process.stdin.drain(), timeout=STDIN_WRITE_TIMEOUT_S)
    except (BrokenPipeError, ConnectionResetError):  # the harness exited or closed stdin without reading it all
        pass
    except asyncio.TimeoutError:
        logger.warning("harness %d did not read its stdin within %.0f s", process.pid, STDIN_WRITE_TIMEOUT_S)
    finally:
        process.stdin.close()


async def run_harness(
    runner: HarnessRunner,
    sandbox: Sandbox,
    context: ExecutionContext,
    *,
    harness_timeout_s: float,
    cancel_event: asyncio.Event | None = None,
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S,
    kill_wait_s: float = DEFAULT_KILL_WAIT_S,
) -> HarnessRun:
    """Run one execution's harness to its close (see the module docstring). The sandbox must have prepared
    `context`'s directories (`sandbox.prepare(context.execution_id)`)."""
    if not harness_timeout_s > 0:
        raise ValueError(f"harness_timeout_s must be > 0, got {harness_timeout_s!r}")
    started = time.monotonic()
    context.log_dir.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = context.log_dir / "stdout.log", context.log_dir / "stderr.log"

    def result(kind: CloseKind, exit_code: int | None, reason: str | None) -> HarnessRun:
        return HarnessRun(
            execution_id=context.execution_id,
            harness=runner.name,
            close_kind=kind,
            exit_code=exit_code,
            duration_s=time.monotonic() - started,
            stdout_path=stdout_path,
            stderr_path=stderr_path,
            workspace=context.workspace,
            reason=reason,
        )

    if cancel_event is not None and cancel_event.is_set():
        stdout_path.touch()
        stderr_path.touch()
        await blocking(sandbox.release, context)
        return result(CloseKind.CANCELLED, None, "cancelled before start")

    process: asyncio.subprocess.Process | None = None
    try:
        with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
            try:
                if sandbox.harness_on_host:  # not: a container runs the image's own copy
                    runner.check()
                spec = runner.launch_spec(context)
                sandbox.check()
                process = await sandbox.start(spec, context, stdout=stdout.fileno(), stderr=stderr.fileno())
            except (HarnessNotFoundError, SandboxError, OSError) as exc:
                reason = f"harness {runner.name!r} could not start: {exc}"
                logger.warning("execution %s: %s", context.execution_id, reason)
                stderr.write(f"gyre: {reason}\n".encode())
                return result(CloseKind.FAILED, None, reason)
        feeding = asyncio.ensure_future(_feed_stdin(process, spec.stdin)) if spec.stdin is not None else None

        waiting = asyncio.ensure_future(process.wait())
        cancelled = asyncio.ensure_future(cancel_event.wait()) if cancel_event is not None else None
        try:
            pending = {waiting} if cancelled is None else {waiting, cancelled}
            await asyncio.wait(pending, timeout=harness_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if cancelled is not None:
                cancelled.cancel()
        if waiting.done():
            kind, reason = CloseKind.COMPLETED, None
            _signal_group(process.pid, signal.SIGKILL)  # what the harness left running in its group ends with it
        else:
            if cancel_event is not None and cancel_event.is_set():
                kind, reason = CloseKind.CANCELLED, "cancelled (surplus)"
            else:
                kind, reason = CloseKind.HARNESS_TIMEOUT, f"harness timeout after {harness_timeout_s:g} s"
            await _stop_group(process, grace_period_s, kill_wait_s, functools.partial(sandbox.stop_inside, context))
        for task in (feeding, waiting):
            if task is not None and not task.done():
                task.cancel()
        return result(kind, process.returncode, reason)
    finally:
        if process is not None and process.returncode is None:  # we were cancelled or failed mid-wait
            _signal_group(process.pid, signal.SIGKILL)
        await blocking(sandbox.release, context)  # reaping and chown walk the tree: off the event loop
