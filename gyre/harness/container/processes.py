"""The processes of one container's executions, found and signalled from the host (no engine call).

A container's processes are host processes in the container's pid namespace: `/proc/<pid>/ns/pid` names the same
namespace as the container's first process (the keeper, `gyre.harness.container.sandbox.KEEPER_SCRIPT`). The engine
starts each `exec` (a harness, an evaluator) as a session leader, so the harness, its children and its daemons lie
outside the keeper's own session, while the keeper's `sleep` lies in it: `members(keeper_pid)` is every process of
the namespace outside that session. `stop(keeper_pid, grace_s)` is the harness lifecycle's stop for them: SIGTERM,
SIGKILL to what is left once `grace_s` has passed, bounded waits. A zombie has no namespace link and is skipped (it
holds nothing; the keeper reaps it). The controller must be allowed to signal them: root, or the user of a rootless
engine. One scan of /proc costs a few ms; an `exec` of a sweep in the container cost ~0.2 s idle and seconds on a
loaded machine (docs/harness.md, "The container sandbox").
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

__all__ = ["members", "stop"]

POLL_S = 0.05
KILL_WAIT_S = 5.0


def _namespace(pid: int) -> tuple[int, int] | None:
    try:
        info = os.stat(f"/proc/{pid}/ns/pid")
    except OSError:  # gone, a zombie, or not ours to read
        return None
    return info.st_dev, info.st_ino


def _session(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold anything
    except (OSError, IndexError):
        return None
    return int(fields[3])  # state, ppid, pgrp, session


def members(keeper_pid: int) -> list[int]:
    """Host pids of the processes in `keeper_pid`'s pid namespace outside its session (module docstring)."""
    namespace, keeper_session = _namespace(keeper_pid), _session(keeper_pid)
    if namespace is None or keeper_session is None:
        return []  # the container has ended: nothing of it runs
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == keeper_pid or _namespace(pid) != namespace:
            continue
        session = _session(pid)
        if session is not None and session != keeper_session:
            found.append(pid)
    return found


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_empty(keeper_pid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := members(keeper_pid)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return left


def stop(keeper_pid: int, grace_s: float) -> list[int]:
    """SIGTERM to `members`, SIGKILL to those left after `grace_s` (0: SIGKILL at once); the pids still there after
    `KILL_WAIT_S` more (none, unless a process is stuck in the kernel)."""
    left = members(keeper_pid)
    if left and grace_s > 0:
        _signal(left, signal.SIGTERM)
        left = _wait_empty(keeper_pid, grace_s)
    for _ in range(3):  # a process may fork between the scan and the signal: scan again
        if not left:
            break
        _signal(left, signal.SIGKILL)
        left = _wait_empty(keeper_pid, KILL_WAIT_S / 3)
    return left
