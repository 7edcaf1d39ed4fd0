"""The processes of one container's executions, found by the container's cgroup and signalled from the host.

Every process of a container lies in its cgroup, or a cgroup below it: also one in a pid namespace of its own
(`unshare -p`), and one started in any session. Inside the container the cgroup filesystem is read-only, so no
process can leave it. The keeper (pid 1, `gyre.harness.container.sandbox`: catatonit in pause mode, bound from the
host, so nothing of the image runs as it) starts no process, so `members` is every process of the cgroup tree but
the keeper. The cgroup's directory is recorded when the container starts (`cgroup_of`): once the container has
ended, the directory is gone and nothing is signalled, even if the keeper's pid has been reused on the host.
`stop(cgroup, keeper, grace_s)`: SIGTERM, SIGKILL to what is left once `grace_s` has passed, bounded waits. The
controller must be allowed to signal them: root, or the user of a rootless engine. One read of the cgroup costs
well under a ms; an `exec` of a sweep in the container cost ~0.2 s idle and seconds on a loaded machine
(docs/harness.md, "The container sandbox").
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

__all__ = ["cgroup_of", "holds", "members", "stop"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
POLL_S = 0.05
KILL_WAIT_S = 5.0


def cgroup_of(pid: int) -> Path:
    """The cgroup directory of process `pid` (v1: its `pids` hierarchy; v2, or hybrid's unified one: its path).
    OSError when there is none to read."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidates.append(CGROUP_ROOT / "pids" / path.lstrip("/"))
        elif controllers == "":
            candidates += [CGROUP_ROOT / path.lstrip("/"), CGROUP_ROOT / "unified" / path.lstrip("/")]
    for directory in candidates:
        if (directory / "cgroup.procs").is_file():
            return directory
    raise OSError(f"no cgroup directory of pid {pid} found (from /proc/{pid}/cgroup: {lines})")


def _procs(cgroup: Path) -> set[int]:
    found: set[int] = set()
    for directory, _dirs, files in os.walk(cgroup):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                found.update(int(line) for line in Path(directory, "cgroup.procs").read_text().split())
    return found


def holds(cgroup: Path, pid: int) -> bool:
    """Whether `pid` is (still) a process of the cgroup tree (not a reused pid of another process)."""
    return pid in _procs(cgroup)


def members(cgroup: Path, keeper_pid: int) -> list[int]:
    """Host pids of every process in the cgroup tree but the keeper (module docstring)."""
    return sorted(_procs(cgroup) - {keeper_pid})


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_empty(cgroup: Path, keeper_pid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := members(cgroup, keeper_pid)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return left


def stop(cgroup: Path, keeper_pid: int, grace_s: float) -> list[int]:
    """SIGTERM to `members`, SIGKILL to those left after `grace_s` (0: SIGKILL at once); the pids still there after
    `KILL_WAIT_S` more (none, unless a process is stuck in the kernel)."""
    left = members(cgroup, keeper_pid)
    if left and grace_s > 0:
        _signal(left, signal.SIGTERM)
        left = _wait_empty(cgroup, keeper_pid, grace_s)
    for _ in range(3):  # a process may fork between the read and the signal: read again
        if not left:
            break
        _signal(left, signal.SIGKILL)
        left = _wait_empty(cgroup, keeper_pid, KILL_WAIT_S / 3)
    return left
