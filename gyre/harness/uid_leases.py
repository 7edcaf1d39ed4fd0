"""Execution uids leased across every controller on one machine.

`LocalSandbox` gives each execution its own uid from `uid_range` when it runs as root (docs/harness.md, "Sandboxes").
Two controllers on one machine (two runs, a Hydra multirun launched in parallel, test workers) draw from the same
range. Without coordination both hand out the same uid, and the `release` of one (which kills every process of
that uid) kills the other's harness mid-run, which then reads as COMPLETED with exit code -9: seen in CI, two
pytest workers, one test's harness killed by the other's sandbox.

A lease is a POSIX record lock on byte `uid` of one file in a directory only this user may write
(`/run/gyre/uid-leases` by default). It is held while an execution has the uid and dropped by the kernel when the
process ends, however it ends (SIGKILL included): a crashed controller leaks no uid, and the uid's leftover
processes are reaped by whoever leases it next. The round-robin cursor lives in the same directory, so a released
uid comes back only after the whole range across controllers, not just within one.

POSIX record locks belong to the process, not to a file descriptor: two sandboxes in one process do not exclude
each other through the lock, and closing any descriptor of the file drops all of them. So there is one
`UidLeases` per directory per process (`leases_for`), its files opened once and never closed, and an in-process
set beside the locks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import threading
from pathlib import Path

__all__ = ["DEFAULT_LEASE_DIR", "UidLeaseError", "UidLeases", "leases_for"]

DEFAULT_LEASE_DIR = Path("/run/gyre/uid-leases")
LEASES_FILE = "leases"  # byte `uid` locked while the uid is leased
CURSOR_FILE = "cursor"  # the last uid handed out on this machine (text), under a whole-file lock


class UidLeaseError(RuntimeError):
    """No uid can be leased (the directory is unusable, or every uid of the range is taken); says why."""


def _private_directory(path: Path) -> Path:
    """`path`, created 0700 if missing; refused when it is a symlink, not a directory, not ours or writable by
    others (anyone who could write there could hold every lease, or swap the files)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        raise UidLeaseError(f"uid lease directory {path}: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UidLeaseError(f"uid lease directory {path} is not a directory (a symlink or a file)")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise UidLeaseError(
            f"uid lease directory {path} must be owned by uid {os.geteuid()} and writable by it alone "
            f"(owner {info.st_uid}, mode {info.st_mode & 0o777:o})"
        )
    return path


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise UidLeaseError(f"uid lease file {path}: {exc.strerror or exc}") from exc


class UidLeases:
    """The uids this process holds, locked against every other process that uses the same directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = _private_directory(Path(directory))
        self._leases_fd = _open(self.directory / LEASES_FILE)
        self._cursor_fd = _open(self.directory / CURSOR_FILE)
        self._held: set[int] = set()
        self._lock = threading.Lock()  # record locks do not exclude this process's own threads

    def held(self) -> frozenset[int]:
        return frozenset(self._held)

    def lease(self, uid_range: tuple[int, int]) -> int:
        """The next uid of `uid_range` after the machine's last one that no process holds and no passwd entry
        names, now held by this process until `release` (or its exit)."""
        low, high = uid_range
        size = high - low + 1
        with self._lock:
            fcntl.lockf(self._cursor_fd, fcntl.LOCK_EX)  # brief: the scan below does no waiting
            try:
                last = self._read_cursor()
                start = last + 1 if low <= last < high else low
                for offset in range(size):
                    uid = low + (start - low + offset) % size
                    if uid in self._held or _has_passwd_entry(uid) or not self._try_lock(uid):
                        continue
                    self._held.add(uid)
                    self._write_cursor(uid)
                    return uid
            finally:
                fcntl.lockf(self._cursor_fd, fcntl.LOCK_UN)
        raise UidLeaseError(
            f"no free uid in {uid_range}: {len(self._held)} held by this process, the rest by other processes "
            f"(leases in {self.directory}) or named in passwd"
        )

    def release(self, uid: int) -> None:
        """Give `uid` back (a no-op for a uid this process does not hold)."""
        with self._lock:
            if uid in self._held:
                fcntl.lockf(self._leases_fd, fcntl.LOCK_UN, 1, uid)
                self._held.discard(uid)

    def _try_lock(self, uid: int) -> bool:
        try:
            fcntl.lockf(self._leases_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, uid)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):  # another process holds it
                return False
            raise
        return True

    def _read_cursor(self) -> int:
        text = os.pread(self._cursor_fd, 32, 0).decode("ascii", "replace").strip()
        with contextlib.suppress(ValueError):
            return int(text)
        return -1  # empty or garbled: start at the range's low end

    def _write_cursor(self, uid: int) -> None:
        data = f"{uid}\n".encode()
        os.pwrite(self._cursor_fd, data, 0)
        os.ftruncate(self._cursor_fd, len(data))


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


_by_directory: dict[Path, UidLeases] = {}
_by_directory_lock = threading.Lock()


def leases_for(directory: Path) -> UidLeases:
    """This process's one `UidLeases` for `directory` (module docstring: why one)."""
    key = Path(os.path.abspath(directory))
    with _by_directory_lock:
        leases = _by_directory.get(key)
        if leases is None:
            leases = _by_directory[key] = UidLeases(key)
        return leases
