"""Budgets of one harness execution (`gyre.harness`): time limits of its lifecycle and per-process rlimits.

`ExecutionLimits` bounds the lifecycle (`gyre.harness.execution.run_harness`, `gyre.harness.episode`);
`ResourceLimits` are the rlimits a sandbox sets in the harness's child process (`gyre.harness.sandbox`).
docs/harness.md ("Configuration") says what each budget does. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.checks import require, require_duration, require_int

GiB = 1 << 30
DEFAULT_GRACE_PERIOD_S = 10.0
DEFAULT_KILL_WAIT_S = 10.0


@dataclass(kw_only=True)
class ResourceLimits:
    """Per-process rlimits set in the harness's child process before exec (None: inherit the controller's).

    Each limit applies to every process of the harness separately (rlimits are per process), except
    `max_processes`, which the kernel counts per real uid: it is applied only when the harness has its own uid
    (LocalSandbox as root), since otherwise it would count the controller's own processes and threads.
    """

    address_space_bytes: int | None = 64 * GiB
    """RLIMIT_AS: virtual memory; node/V8 reserve several GiB up front."""
    cpu_seconds: int | None = 24 * 3600
    """RLIMIT_CPU: CPU time per process (SIGXCPU, then SIGKILL)."""
    file_size_bytes: int | None = 16 * GiB
    """RLIMIT_FSIZE: largest file a process may write (SIGXFSZ)."""
    max_processes: int | None = 1024
    """RLIMIT_NPROC: processes + threads of the harness's uid."""
    open_files: int | None = 65536
    """RLIMIT_NOFILE: open file descriptors per process."""

    def __post_init__(self) -> None:
        for name in ("address_space_bytes", "cpu_seconds", "file_size_bytes", "max_processes", "open_files"):
            value = getattr(self, name)
            if value is not None:
                require_int(f"ResourceLimits.{name}", value, gt=0, note="or None to inherit the controller's")


@dataclass(kw_only=True)
class ExecutionLimits:
    """Time and resource budgets of one execution (docs/harness.md, "Configuration")."""

    harness_timeout_s: float = 4 * 3600.0
    """The harness's own budget; past it: HARNESS_TIMEOUT, its work is still scored."""
    overall_timeout_s: float = 6 * 3600.0
    """Harness + evaluation; past it: OVERALL_TIMEOUT, the execution is excluded from training."""
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    """Between SIGTERM and SIGKILL of the harness's process group."""
    kill_wait_s: float = DEFAULT_KILL_WAIT_S
    """Bound on waiting for the process group to die after SIGKILL."""
    resources: ResourceLimits = field(default_factory=ResourceLimits)
    """Per-process rlimits in the sandbox."""

    def __post_init__(self) -> None:
        for name in ("harness_timeout_s", "overall_timeout_s", "grace_period_s", "kill_wait_s"):
            require_duration(f"ExecutionLimits.{name}", getattr(self, name))
        require(
            self.overall_timeout_s >= self.harness_timeout_s,
            "ExecutionLimits.overall_timeout_s",
            self.overall_timeout_s,
            f"a number >= harness_timeout_s ({self.harness_timeout_s:g}): the overall budget covers the harness "
            "and its evaluation",
        )
