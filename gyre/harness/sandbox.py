"""Where a harness runs: one private directory tree, process session, resource limits and environment per execution.

Contract (`Sandbox`): `prepare(execution_id)` creates the execution's directories (workspace, home, logs) and
returns them; the caller builds the `ExecutionContext` from them. `start(spec, context, stdout=, stderr=)` writes
the spec's files, starts the harness in a NEW SESSION (its pid is its process group id, so the whole group can be
signalled) with exactly `spec.env` (plus TMPDIR) and returns the asyncio process. `release(context)` runs after
the process has ended or been killed: it reaps anything the harness left behind and hands the workspace back to
the controller; the workspace itself is always preserved (its work is what gets scored).

Implementations (what each isolates is measured in tests/integration/test_harness_sandbox.py, docs/harness.md):
- `LocalSandbox`: plain processes. Resource limits (and the execution's own uid, below) are set by util-linux's
  `prlimit` and `setpriv`, which exec the harness: the controller then starts it without a Python `preexec_fn`,
  which would make CPython fork the whole controller (torch, engines, GBs of pages) and wait, on the event loop,
  until the child has run Python code and exec'd (measured from a 1.6 GB process: 146 ms a start; on a full
  machine 0.5-5 s, while every call on that loop waited). Where either tool is missing, a `preexec_fn` does it.
  When the controller runs as root it gives every execution its OWN uid (leased round robin from `uid_range`,
  exclusive across every controller on the machine: `gyre.harness.uid_leases`; no passwd entry needed) and
  chowns the execution's workspace and home to it with mode 0700: other executions' workspaces, the run
  directory (made private with `protected_paths`) and anything else not world-readable are then closed to the
  harness. Without root it isolates processes and environment only.
- `BubblewrapSandbox`: `bwrap` (a mount namespace) on top of `LocalSandbox`: only system directories (read-only),
  the harness's install prefix (read-only), `ro_binds` and the execution's own workspace and home (read-write)
  exist inside; a private /tmp, /proc of its own pid namespace.
- `ContainerSandbox` (`gyre.harness.container`): one podman or docker container of the task's image per execution,
  harness and evaluation in it; `ApptainerSandbox`: the argv of `apptainer exec`, tested for its argv only.

Beyond the contract above, what every sandbox answers (no-ops here, a container's lifecycle there):
`prepare(execution_id, task)` gets the task (its image), `proxy_url(url)` says how a harness inside reaches the
proxy, `stop_inside(context, grace_s)` stops what runs beyond the started process's group, `close(execution_id)`
ends the execution's sandbox once the episode is over (evaluation included), `shutdown()` ends what is left at the
run's end; `evaluates_in_execution` and `harness_on_host` say where the evaluator and the harness's program are.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from gyre.config.harness import ResourceLimits
from gyre.harness.protocol import ExecutionContext, LaunchSpec
from gyre.harness.uid_leases import DEFAULT_LEASE_DIR, UidLeaseError, UidLeases, leases_for
from gyre.tasks.spec import Task

__all__ = [
    "ApptainerSandbox",
    "BubblewrapSandbox",
    "ExecutionDirs",
    "ImageUnavailable",
    "LocalSandbox",
    "Sandbox",
    "SandboxError",
    "write_launch_files",
]

logger = logging.getLogger(__name__)

REAP_TIMEOUT_S = 10.0  # bound on the helper that kills an execution uid's leftover processes
PRIVATE_DIR_MODE = 0o700
TRAVERSE_ONLY_MODE = 0o711  # others may pass through to their own subdirectory, not list it


class SandboxError(RuntimeError):
    """The sandbox cannot host this execution (misconfiguration, missing tool, permission); the message says why."""


class ImageUnavailable(SandboxError):
    """The task's image could not be pulled or built (the message names the image and the engine's words): its
    executions close FAILED, the placeholder outcome, without trying again (`gyre.harness.container.images`)."""


def rlimit_pairs(limits: ResourceLimits, *, own_uid: bool) -> list[tuple[int, int]]:
    """(resource, value) pairs to set, soft = hard = value; RLIMIT_NPROC only for a harness with its own uid."""
    pairs = [
        (resource.RLIMIT_AS, limits.address_space_bytes),
        (resource.RLIMIT_CPU, limits.cpu_seconds),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
    ]
    if own_uid:
        pairs.append((resource.RLIMIT_NPROC, limits.max_processes))
    return [(res, value) for res, value in pairs if value is not None]


def _capped(limits: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each value no higher than the hard limit this process has (which its children inherit)."""
    capped = []
    for res, value in limits:
        _soft, hard = resource.getrlimit(res)
        capped.append((res, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return capped


PRLIMIT_OPTIONS = {
    resource.RLIMIT_AS: "--as",
    resource.RLIMIT_CPU: "--cpu",
    resource.RLIMIT_FSIZE: "--fsize",
    resource.RLIMIT_NOFILE: "--nofile",
    resource.RLIMIT_NPROC: "--nproc",
}


def exec_wrapper(limits: list[tuple[int, int]], uid: int | None) -> list[str] | None:
    """The argv prefix that sets `limits` (soft = hard) and, as root, drops to `uid` before it execs the harness
    (same pid: the session leader is the harness): util-linux's `prlimit`, then `setpriv` (groups cleared, real,
    effective and saved uid and gid set, and SIGTERM as the parent-death signal, set after the uid: a harness gets
    the stop's SIGTERM from the kernel when the controller that started it dies, even by SIGKILL, and can end what
    it started, as at a stop; the SIGKILL that follows a stop's grace period cannot come, its sender is gone).
    [] where setpriv is missing and there is nothing else to set; None where a tool needed for the limits or the
    uid is missing (the preexec fallback)."""
    argv: list[str] = []
    if limits:
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            return None
        argv += [prlimit, *(f"{PRLIMIT_OPTIONS[res]}={cap}:{cap}" for res, cap in _capped(limits)), "--"]
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None if uid is not None or argv else []
    argv.append(setpriv)
    if uid is not None:
        argv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [*argv, "--pdeathsig=TERM", "--"]


PR_SET_PDEATHSIG = 1  # prctl(2)


def _child_setup(limits: list[tuple[int, int]], uid: int | None) -> Callable[[], None]:
    """The child's preexec, between fork and exec, where `exec_wrapper`'s tools are missing: set the rlimits, then
    (as root) drop to the execution's uid, then SIGTERM as the parent-death signal (a uid change clears it).

    Done here rather than with Popen's `user=`/`group=`, which uvloop's subprocess_exec (the controller's loop,
    gyre.eventloop) refuses. Only `setrlimit`/`set*id`/`prctl` calls: no imports, no logging, no locks of other
    threads (libc is loaded before the fork).
    """
    capped = _capped(limits)
    libc = ctypes.CDLL(None, use_errno=True)

    def setup() -> None:
        for res, cap in capped:
            resource.setrlimit(res, (cap, cap))
        if uid is not None:  # groups first: after setuid there is no privilege left to change them
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return setup


@dataclass(frozen=True)
class ExecutionDirs:
    """One execution's directory tree: `root/<execution_id>/{workspace,home,logs}`; TMPDIR is `home/tmp`."""

    root: Path
    workspace: Path
    home: Path
    log_dir: Path

    @property
    def tmp(self) -> Path:
        return self.home / "tmp"


@runtime_checkable
class Sandbox(Protocol):
    """Where and how isolated one execution's harness runs (see the module docstring for the contract)."""

    name: str

    def check(self) -> None:
        """Raise `SandboxError` if this sandbox cannot run here (tool missing, configuration unusable)."""
        ...

    def prepare(self, execution_id: str, task: Task | None = None) -> ExecutionDirs:
        """Create the execution's directories (idempotent for the same id); `task`: what it runs (its image)."""
        ...

    def proxy_url(self, url: str) -> str:
        """The proxy's base URL as a harness in this sandbox reaches it."""
        ...

    def close(self, execution_id: str) -> None:
        """The execution is over (harness and evaluation): end what the sandbox still holds of it."""
        ...

    evaluates_in_execution: bool  # the evaluator runs inside the execution's own sandbox (a container)
    harness_on_host: bool  # the harness's program is the host's, which its runner checks here first

    async def stop_inside(self, context: ExecutionContext, grace_s: float) -> None:
        """At a stop: give what runs beyond the started process's group (a container's) SIGTERM, then SIGKILL."""
        ...

    def shutdown(self) -> None:
        """The run has ended: end whatever of its executions the sandbox still holds."""
        ...

    async def start(
        self, spec: LaunchSpec, context: ExecutionContext, *, stdout: int, stderr: int
    ) -> asyncio.subprocess.Process:
        """Write `spec.files`, start `spec.argv` in a new session in `context.workspace`; stdout/stderr are fds."""
        ...

    def release(self, context: ExecutionContext) -> None:
        """After the harness ended: reap its leftovers, hand the preserved workspace back to the controller."""
        ...

    def uid_of(self, execution_id: str) -> int | None:
        """The uid a prepared execution runs as (None: the controller's own)."""
        ...


def _check_id(execution_id: str) -> None:
    if not execution_id or "/" in execution_id or execution_id in (".", "..") or "\0" in execution_id:
        raise ValueError(f"execution_id must be a non-empty name without '/', got {execution_id!r}")


def _inside(path: Path, parent: Path) -> bool:
    try:
        path.resolve().relative_to(parent.resolve())
    except ValueError:
        return False
    return True


def chown_tree(top: Path, uid: int, gid: int) -> None:
    """chown `top` and everything below it, never following symlinks (a harness may plant links anywhere).

    Walks by directory file descriptors (`os.fwalk`): a directory swapped for a symlink while the walk runs is
    not followed, so root never chowns anything outside `top`."""
    os.chown(top, uid, gid, follow_symlinks=False)
    for _dirpath, dirnames, filenames, dir_fd in os.fwalk(top, follow_symlinks=False):
        for name in (*dirnames, *filenames):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)


def write_launch_files(spec: LaunchSpec, context: ExecutionContext) -> None:
    """Write `spec.files`, each inside the execution's home or workspace, never through a symlink the harness may
    have planted there (the controller writes as root into directories the harness owned before, on a re-run)."""
    for path, text in spec.files.items():
        path = Path(path)
        if not (_inside(path, context.home) or _inside(path, context.workspace)):
            raise SandboxError(f"launch file {path} lies outside the execution's home and workspace")
        top = context.home if _inside(path, context.home) else context.workspace
        for part in (path, *path.parents):
            if part == top:
                break
            if part.is_symlink():
                raise SandboxError(f"launch file {path}: {part} is a symlink; refusing to write through it")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def unreachable_by_others(executable: str) -> Path | None:
    """The first directory or file on the way to `executable` (the directories of the path as given, then those of
    its target, symlinks resolved) that a uid other than its owner cannot traverse or execute; None when an
    unrelated uid can run it."""
    given = Path(os.path.abspath(executable))
    target = Path(os.path.realpath(executable))
    for path in (*reversed(given.parents), *reversed(target.parents), target):
        if not path.stat().st_mode & 0o001:
            return path
    return None


@dataclass(kw_only=True)
class LocalSandbox:
    """Plain processes: own dirs, own session, rlimits, the given environment only; its own uid when root."""

    root: Path  # executions live in root/<execution_id>/; every ancestor must be traversable (o+x) for own-uid runs
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    isolate_user: bool | None = None  # None: an own uid per execution exactly when the controller runs as root
    uid_range: tuple[int, int] = (6_100_000, 6_199_999)  # inclusive; uids with a passwd entry are skipped
    lease_dir: Path = DEFAULT_LEASE_DIR  # where uids are leased: controllers sharing it never share a uid
    protected_paths: Sequence[Path] = ()  # made private (chmod go-rwx) at check(); e.g. the run dir, checkpoints
    name: str = "local"

    def __post_init__(self) -> None:
        self.root = Path(self.root).absolute()
        self.protected_paths = tuple(Path(p).absolute() for p in self.protected_paths)
        if self.isolate_user is None:
            self.isolate_user = os.geteuid() == 0
        low, high = self.uid_range
        if not 0 < low <= high:
            raise ValueError(f"LocalSandbox.uid_range must be (low, high) with 0 < low <= high, got {self.uid_range}")
        for path in self.protected_paths:
            if _inside(self.root, path):
                raise ValueError(
                    f"LocalSandbox.root {self.root} lies inside protected path {path}: the harness could not reach "
                    "its workspace once that path is private; put the executions' root outside it"
                )
        self._uids: dict[str, int] = {}  # execution id -> uid, while prepared and not released
        self._uids_lock = threading.Lock()  # prepare and release run in worker threads, several at once
        self._leases: UidLeases | None = None  # set by check() when isolating users
        self._checked = False

    # -- setup --------------------------------------------------------------------------------------
    def check(self) -> None:
        if self.isolate_user:
            if os.geteuid() != 0:
                raise SandboxError("LocalSandbox(isolate_user=True) needs root to give each execution its own uid")
            for ancestor in (self.root, *self.root.parents):
                if ancestor.exists() and not ancestor.stat().st_mode & 0o001:
                    raise SandboxError(
                        f"{ancestor} is not traversable by other users (mode {ancestor.stat().st_mode & 0o777:o}): an "
                        f"execution's own uid cannot reach its workspace under {self.root}; choose another root or "
                        "chmod o+x it"
                    )
            try:
                self._leases = leases_for(self.lease_dir)
            except UidLeaseError as exc:
                raise SandboxError(f"LocalSandbox.lease_dir: {exc}") from exc
        for path in self.protected_paths:
            if path.exists():
                os.chmod(path, path.stat().st_mode & ~0o077)
        self._checked = True

    def prepare(self, execution_id: str, task: Task | None = None) -> ExecutionDirs:
        _check_id(execution_id)
        if not self._checked:
            self.check()
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, TRAVERSE_ONLY_MODE)
        top = self.root / execution_id
        dirs = ExecutionDirs(root=top, workspace=top / "workspace", home=top / "home", log_dir=top / "logs")
        for path in (top, dirs.workspace, dirs.home, dirs.tmp, dirs.log_dir):
            path.mkdir(exist_ok=True)
        os.chmod(top, TRAVERSE_ONLY_MODE)
        os.chmod(dirs.log_dir, PRIVATE_DIR_MODE)  # written by the controller through fds only
        for path in (dirs.workspace, dirs.home):
            os.chmod(path, PRIVATE_DIR_MODE)
        if self.isolate_user:
            with self._uids_lock:  # leased and recorded at once: two executions never share a uid
                uid = self._uids.get(execution_id)
                fresh = uid is None
                if uid is None:
                    uid = self._uids[execution_id] = self._lease_uid()
            if fresh:
                self._reap(uid)  # the leftovers of a controller that held this uid and died
            for path in (dirs.workspace, dirs.home):
                chown_tree(path, uid, uid)
        return dirs

    def uid_of(self, execution_id: str) -> int | None:
        """The uid an execution runs as (None: the controller's own)."""
        return self._uids.get(execution_id)

    evaluates_in_execution = False  # a separate evaluation execution (`gyre.harness.evaluation.SandboxHost`)
    harness_on_host = True

    def proxy_url(self, url: str) -> str:
        return url  # the harness shares the controller's network

    def close(self, execution_id: str) -> None:
        pass  # `release` handed everything back already

    async def stop_inside(self, context: ExecutionContext, grace_s: float) -> None:
        pass  # the harness is all in its process group, which `run_harness` signals

    def shutdown(self) -> None:
        pass

    def _lease_uid(self) -> int:
        """The next uid of `uid_range` no controller on this machine holds (`gyre.harness.uid_leases`: round robin
        across controllers, so files a released uid left in a shared /tmp do not pass to the next execution soon).
        Call with `_uids_lock` held."""
        assert self._leases is not None  # check() ran (prepare calls it)
        try:
            return self._leases.lease(self.uid_range)
        except UidLeaseError as exc:
            raise SandboxError(f"LocalSandbox.uid_range: {exc}") from exc

    # -- start --------------------------------------------------------------------------------------
    def _environment(self, spec: LaunchSpec, context: ExecutionContext) -> dict[str, str]:
        env = dict(spec.env)
        env.setdefault("TMPDIR", str(context.home / "tmp"))
        return env

    def command(self, spec: LaunchSpec, context: ExecutionContext) -> list[str]:
        """The argv actually executed (subclasses wrap it)."""
        return list(spec.argv)

    async def start(
        self, spec: LaunchSpec, context: ExecutionContext, *, stdout: int, stderr: int
    ) -> asyncio.subprocess.Process:
        uid = self._uids.get(context.execution_id)
        if self.isolate_user and uid is None:
            raise SandboxError(f"execution {context.execution_id!r} was not prepared by this sandbox (call prepare)")
        if uid is not None and os.path.isabs(spec.argv[0]):
            closed = unreachable_by_others(spec.argv[0])
            if closed is not None:
                raise SandboxError(
                    f"{spec.argv[0]} cannot be run by the execution's own uid {uid}: {closed} is closed to other "
                    "users; install the harness where all users may read it, use BubblewrapSandbox, or "
                    "LocalSandbox(isolate_user=False)"
                )
        write_launch_files(spec, context)
        if uid is not None:
            # Everything the controller put there since `prepare` (the task's template files, the launch files)
            # becomes the execution's to change.
            for path in (context.workspace, context.home):
                chown_tree(path, uid, uid)
        limits = rlimit_pairs(self.limits, own_uid=uid is not None)
        wrapper = exec_wrapper(limits, uid)
        return await asyncio.create_subprocess_exec(
            *(wrapper or ()),
            *self.command(spec, context),
            cwd=context.workspace,
            env=self._environment(spec, context),
            stdin=subprocess.DEVNULL if spec.stdin is None else subprocess.PIPE,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=_child_setup(limits, uid) if wrapper is None else None,  # no preexec: no fork of us all
        )

    # -- release ------------------------------------------------------------------------------------
    def _reap(self, uid: int) -> None:
        """Kill every process of `uid`: a helper that becomes `uid` sends SIGKILL to -1 (everything it may signal
        but itself). Through `setpriv` where it exists (no fork of the controller, as at start); else a preexec."""
        wrapper = exec_wrapper([], uid)

        def kill_all() -> None:
            with contextlib.suppress(ProcessLookupError):  # nothing of uid left to kill
                os.kill(-1, signal.SIGKILL)  # as uid: every process of uid except this one

        try:
            subprocess.run(
                [*wrapper, "/bin/sh", "-c", "kill -s KILL -- -1"] if wrapper else ["/bin/sh", "-c", ":"],
                user=None if wrapper else uid,
                group=None if wrapper else uid,
                extra_groups=None if wrapper else [],
                preexec_fn=None if wrapper else kill_all,
                env={},
                timeout=REAP_TIMEOUT_S,
                check=False,  # kill exits 1 when nothing of uid was left
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except subprocess.SubprocessError as exc:  # the helper could not become uid or start: log, nothing to undo
            logger.debug("reaping uid %d: %s", uid, exc)

    def release(self, context: ExecutionContext) -> None:
        with self._uids_lock:
            uid = self._uids.get(context.execution_id)
        if uid is None:
            return
        self._reap(uid)
        try:
            me = os.geteuid(), os.getegid()
            for path in (context.workspace, context.home):
                if path.exists():
                    chown_tree(path, *me)  # preserved for evaluation, private to the controller from now on
        finally:
            with self._uids_lock:  # free only now: no process of the uid is left, nothing of it is its own
                self._uids.pop(context.execution_id, None)
            if self._leases is not None:
                self._leases.release(uid)


SYSTEM_RO_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_RO_PATHS = (
    "/etc/alternatives",
    "/etc/ca-certificates",
    "/etc/ssl",
    "/etc/pki",
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/localtime",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
)


def python_paths() -> tuple[Path, ...]:
    """What this process's Python reads beyond the system directories when a harness or an evaluator runs it: its
    prefix (a venv), its base prefix (the interpreter and standard library) and the gyre package. Not the rest of
    `sys.path`: it can hold the directory a run was started from (a home directory), which would then be bound into
    every sandbox; a package installed in editable mode elsewhere is therefore not there."""
    import gyre

    paths: list[Path] = []
    for path in (Path(sys.prefix), Path(sys.base_prefix), Path(gyre.__file__).resolve().parent):
        if path.is_dir() and path not in paths:
            paths.append(path)
    return tuple(paths)


def install_prefix(executable: str) -> Path | None:
    """The directory a harness binary needs read-only: an npm prefix (above node_modules) or its own directory."""
    path = Path(executable)
    if not path.is_absolute():
        return None
    if any(str(path).startswith(p + "/") for p in SYSTEM_RO_PATHS):
        return None
    parts = path.parts
    if "node_modules" in parts:
        return Path(*parts[: parts.index("node_modules")])
    return path.resolve().parent


@dataclass(kw_only=True)
class BubblewrapSandbox(LocalSandbox):
    """`LocalSandbox` inside `bwrap`: a mount namespace holding only system dirs (read-only) and the execution's own.

    The harness keeps the host network (it must reach the proxy on 127.0.0.1) and runs as the controller's uid
    unless `isolate_user` (default here: False, the mount namespace is the isolation).
    """

    bwrap: str = "bwrap"
    ro_binds: Sequence[Path] = ()  # extra read-only paths (a venv, an agent's code), bound at the same path
    isolate_user: bool | None = False
    name: str = "bubblewrap"

    def check(self) -> None:
        if shutil.which(self.bwrap) is None:
            raise SandboxError(f"{self.bwrap!r} not found: install bubblewrap (Debian: apt-get install bubblewrap)")
        super().check()

    def command(self, spec: LaunchSpec, context: ExecutionContext) -> list[str]:
        # No --die-with-parent: it would SIGKILL the harness the moment bwrap itself dies of the group's SIGTERM,
        # leaving it no grace period. The harness shares bwrap's process group, so the group's signals reach it.
        argv = [shutil.which(self.bwrap) or self.bwrap, "--unshare-pid", "--unshare-ipc"]
        for path in SYSTEM_RO_PATHS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                argv += ["--ro-bind", path, path]
        for path in ETC_RO_PATHS:
            if os.path.exists(path):
                argv += ["--ro-bind", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]  # before the binds: /tmp would hide them
        extra = [Path(p).absolute() for p in (*self.ro_binds, *spec.ro_paths)]
        prefix = install_prefix(spec.argv[0])
        if prefix is not None:
            extra.append(prefix)
        for path in extra:
            argv += ["--ro-bind", str(path), str(path)]
        for path in (context.workspace, context.home):
            argv += ["--bind", str(path), str(path)]
        argv += ["--chdir", str(context.workspace), "--", *spec.argv]
        return argv


@dataclass(kw_only=True)
class ApptainerSandbox(LocalSandbox):
    """The harness in `apptainer exec` of a SIF image: the argv only (apptainer cannot be installed on the
    development machines, so it is tested for the argv it builds; docs/cluster.md, "Only apptainer").

    Only the execution's workspace and home are mounted (at the same paths). Environment values never appear on
    the command line: `APPTAINERENV_NAME` variables with `--cleanenv`. Apptainer's processes are the client's own
    children: the process group kill ends them. Podman and docker: `gyre.harness.container.ContainerSandbox`.
    """

    image: str = ""  # the path of an apptainer .sif
    extra_args: Sequence[str] = ()
    isolate_user: bool | None = False
    name: str = "container"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.image:
            raise ValueError("ApptainerSandbox.image is required (the path of an apptainer .sif)")

    def check(self) -> None:
        if shutil.which("apptainer") is None:
            raise SandboxError("container engine 'apptainer' not found on PATH (docs/cluster.md, 'Only apptainer')")
        super().check()

    def command(self, spec: LaunchSpec, context: ExecutionContext) -> list[str]:
        argv = ["apptainer", "exec", "--containall", "--cleanenv", "--no-home"]
        for path in (context.workspace, context.home):
            argv += ["--bind", f"{path}:{path}"]
        for path in spec.ro_paths:
            argv += ["--bind", f"{path}:{path}:ro"]
        return [*argv, "--pwd", str(context.workspace), *self.extra_args, self.image, *spec.argv]

    def _environment(self, spec: LaunchSpec, context: ExecutionContext) -> dict[str, str]:
        env = super()._environment(spec, context)
        return {"PATH": os.environ.get("PATH", os.defpath), **{f"APPTAINERENV_{k}": v for k, v in env.items()}}
