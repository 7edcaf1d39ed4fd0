"""Budgets of one harness execution (`gyre.harness`) and the settings of gyre's builtin harness.

`ExecutionLimits` bounds the lifecycle (`gyre.harness.execution.run_harness`, `gyre.harness.episode`);
`ResourceLimits` are the rlimits a sandbox sets in the harness's child process (`gyre.harness.sandbox`).
docs/harness.md ("Configuration") says what each budget does. `AgentConfig` is the builtin harness's agent loop
(`gyre.harness.builtin.agent`; its command line sets it, docs/builtin-harness.md). `HarnessConfig` is which
harness a training run starts per execution (`gyre.harness.runners.runner_for`) and in which sandbox.
Pure: stdlib only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gyre.config.checks import require, require_bool, require_choice, require_duration, require_int, require_number

GiB = 1 << 30
DEFAULT_GRACE_PERIOD_S = 10.0
DEFAULT_KILL_WAIT_S = 10.0
HARNESS_NAMES = ("builtin", "claude_code", "codex", "command")  # the names of gyre.harness.runners.RUNNERS
BUILTIN_BACKENDS = ("anthropic", "openai", "anthropic-http")  # gyre.harness.builtin.agent's backends
SANDBOXES = ("local", "bubblewrap", "container")
HARNESS_HOSTS = ("controller", "nodes")  # where executions run: docs/cluster.md, "Harness hosts on every node"
CONTAINER_ENGINES = ("docker", "podman", "apptainer")
CONTAINER_NETWORKS = ("proxy", "host")  # docs/harness.md, "Container network"
IMAGE_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")  # an OCI reference, never an engine's '-' option
WORKDIR_RE = re.compile(r"^/[^:,\s]+$")  # a container path: no ':' or ',' (the engine's -v separators)


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


@dataclass(kw_only=True)
class AgentConfig:
    """The builtin harness's agent loop: turn budgets, compaction, delegation and retries of its model calls."""

    max_turns: int = 30  # model turns of the main agent (summary requests not counted)
    sub_agent_max_turns: int = 10  # model turns of each sub-agent
    context_limit: int = 0  # tokens the API allows per call; 0 = unknown (only reactive compaction)
    compact_fraction: float = 0.8  # compact before a call once the last call's tokens reach this fraction
    keep_tail: int = 1  # (assistant, tool results) exchanges kept verbatim after a compaction
    force_compaction_after: int = 0  # main agent: compact every N turns (tests); 0 = off
    force_delegation: bool = False  # main agent's first turn delegates the task (tests)
    delegation: bool = True  # offer the `delegate` tool to the main agent
    max_retries: int = 4  # per call, for transient failures
    retry_base_s: float = 0.5  # first backoff; doubles per retry
    retry_max_s: float = 8.0  # cap on one backoff

    def __post_init__(self) -> None:
        for name in ("max_turns", "sub_agent_max_turns"):
            require_int(f"AgentConfig.{name}", getattr(self, name), ge=1)
        for name in ("context_limit", "keep_tail", "force_compaction_after", "max_retries"):
            require_int(f"AgentConfig.{name}", getattr(self, name), ge=0)
        require_number("AgentConfig.compact_fraction", self.compact_fraction, gt=0, le=1)
        require_bool("AgentConfig.force_delegation", self.force_delegation)
        require_bool("AgentConfig.delegation", self.delegation)
        require_duration("AgentConfig.retry_base_s", self.retry_base_s, allow_zero=True)
        require_duration("AgentConfig.retry_max_s", self.retry_max_s, allow_zero=True)
        require(
            self.delegation or not self.force_delegation,
            "AgentConfig.force_delegation",
            self.force_delegation,
            "false unless delegation (the delegate tool) is on",
        )


@dataclass(kw_only=True)
class ContainerConfig:
    """`harness.sandbox=container`: the engine, the task set's default image, and how containers start
    (docs/harness.md, "The container sandbox")."""

    engine: str = "podman"
    """podman or docker (one CLI shape), or apptainer (its argv only: docs/cluster.md)."""
    image: str = ""
    """The image of tasks that name none (no [environment] image and no environment/Dockerfile); pulled when
    absent. Required when such a task is in the task set."""
    max_starting: int = 4
    """Containers being created at once on one node (`run -d` and the `inspect` after it); the others wait."""
    max_preparing: int = 2
    """Image pulls and builds at once on one node, before the first dispatch."""
    build_timeout_s: float = 900.0
    """A build or pull past it fails (a task's [environment] build_timeout_s overrides it for its build)."""
    network: str = "proxy"
    """proxy: the container's own network namespace where only the proxy's port is forwarded (a task's
    allow_internet adds a user-mode route to the internet); host: the host's network (everything of the job is
    reachable; for engines where the forward cannot be made, e.g. docker without root)."""
    workdir: str = "/workspace"
    """Where the execution's workspace is mounted in the container (a task's [environment] workdir overrides it)."""
    cpus: float = 0.0
    """CPUs per container (0: no limit; a task's [environment] cpus overrides it)."""
    memory_mb: int = 0
    """Memory per container in MiB (0: no limit; a task's [environment] memory_mb overrides it)."""
    harness_from_image: bool = False
    """Run the harness program the image has (found on the image's PATH by name) instead of the host's install
    bound read-only."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra labels on every container and built image (e.g. a test session's)."""

    def __post_init__(self) -> None:
        require_choice("harness.container.engine", self.engine, CONTAINER_ENGINES)
        require(isinstance(self.image, str), "harness.container.image", self.image, "an image reference or ''")
        sif = self.engine == "apptainer"
        require(
            not self.image or (self.image.startswith("/") if sif else IMAGE_REF_RE.match(self.image) is not None),
            "harness.container.image",
            self.image,
            "the absolute path of a .sif with engine=apptainer"
            if sif
            else "an image reference (letters, digits, '._/:@-', not starting with one)",
        )
        require_int("harness.container.max_starting", self.max_starting, ge=1)
        require_int("harness.container.max_preparing", self.max_preparing, ge=1)
        require_duration("harness.container.build_timeout_s", self.build_timeout_s)
        require_choice("harness.container.network", self.network, CONTAINER_NETWORKS)
        require(
            isinstance(self.workdir, str) and WORKDIR_RE.match(self.workdir) is not None and ".." not in self.workdir,
            "harness.container.workdir",
            self.workdir,
            "an absolute path below / (no ':' or ',')",
        )
        require_number("harness.container.cpus", self.cpus, ge=0)
        require_int("harness.container.memory_mb", self.memory_mb, ge=0)
        require_bool("harness.container.harness_from_image", self.harness_from_image)
        require(
            isinstance(self.labels, dict)
            and all(isinstance(k, str) and k and isinstance(v, str) for k, v in self.labels.items()),
            "harness.container.labels",
            self.labels,
            "a mapping of label names to strings",
        )


@dataclass(kw_only=True)
class HarnessConfig:
    """Which harness runs each execution of a training run, with its options and its sandbox (docs/harness.md)."""

    name: str = "builtin"
    """builtin (gyre's reference harness on the Anthropic or OpenAI SDK), claude_code (the Claude Code CLI), codex
    (the Codex CLI) or command (any agent on the SDKs, started from `argv`)."""
    backend: str = "anthropic"
    """builtin: how its agent calls the proxy: anthropic (the Anthropic SDK, Messages API), openai (the OpenAI SDK,
    Chat Completions) or anthropic-http (the Messages API over Python's own HTTP client: no SDK, a harness process
    that starts ~1.5 CPU s sooner)."""
    max_turns: int = 30
    """builtin: model turns of the main agent."""
    binary: str = ""
    """claude_code, codex: path or name of the CLI; empty: PATH, then the npm test cache."""
    argv: list[str] = field(default_factory=list)
    """command: the argv template, e.g. [python, agent.py, "{prompt}"] (fields: docs/harness.md); required there."""
    extra_args: list[str] = field(default_factory=list)
    """builtin, claude_code, codex: flags added to the harness's command line."""
    env: dict[str, str] = field(default_factory=dict)
    """Fixed additions to the harness's environment (it inherits nothing of the controller's)."""
    instructions_file: str = ""
    """claude_code, codex: a text file of project instructions written into each execution's private HOME as
    ~/.claude/CLAUDE.md or $CODEX_HOME/AGENTS.md (a task's metadata.instructions follows it); empty: none."""
    settings_file: str = ""
    """claude_code: a JSON object written as the execution's ~/.claude/settings.json; codex: TOML lines added to the
    config.toml gyre writes per execution; empty: none. Read and checked at start (exit 2 with one line)."""
    sandbox: str = "local"
    """local (plain processes, an own uid per execution as root), bubblewrap or container."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """sandbox=container: the engine, the default image, limits and starts (docs/harness.md)."""
    isolate_user: bool | None = None
    """sandbox=local: run each execution under its own uid (needs root; the harness's interpreter or binary must be
    readable by other users). null: own uid when the controller runs as root, except for the builtin harness on the
    bundled demo family, whose agent has only the calculator tool (no shell or file tools)."""

    hosts: str = "controller"
    """Where the executions run: controller (every harness on rank 0's node, beside the proxy) or nodes (each node of
    the job runs those the controller places there, on the node with the fewest running: its first rank hosts them;
    docs/cluster.md, "Harness hosts on every node")."""

    def __post_init__(self) -> None:
        require_choice("harness.name", self.name, HARNESS_NAMES)
        require_choice("harness.hosts", self.hosts, HARNESS_HOSTS)
        require_choice("harness.backend", self.backend, BUILTIN_BACKENDS)
        require_int("harness.max_turns", self.max_turns, ge=1)
        require(isinstance(self.binary, str), "harness.binary", self.binary, "a path or a name on PATH")
        for name in ("argv", "extra_args"):
            value = getattr(self, name)
            require(
                isinstance(value, list) and all(isinstance(a, str) for a in value),
                f"harness.{name}",
                value,
                "a list of strings",
            )
        require(
            isinstance(self.env, dict)
            and all(isinstance(k, str) and k and isinstance(v, str) for k, v in self.env.items()),
            "harness.env",
            self.env,
            "a mapping of variable names to strings",
        )
        for name in ("instructions_file", "settings_file"):
            require(isinstance(getattr(self, name), str), f"harness.{name}", getattr(self, name), "a file path or ''")
        require_choice("harness.sandbox", self.sandbox, SANDBOXES)
        require(
            self.isolate_user is None or isinstance(self.isolate_user, bool),
            "harness.isolate_user",
            self.isolate_user,
            "true, false or null (auto)",
        )
        if self.name == "command":
            require(
                bool(self.argv) and bool(self.argv[0]),
                "harness.argv",
                self.argv,
                "a non-empty argv template with harness.name=command",
            )
        else:
            require(
                not self.argv,
                "harness.argv",
                self.argv,
                f"[] with harness.name={self.name} (argv is the command harness's)",
            )
        if self.name not in ("claude_code", "codex"):
            require(
                not self.binary,
                "harness.binary",
                self.binary,
                f"'' with harness.name={self.name} (binary is the claude_code and codex CLIs' path)",
            )
        if self.name == "command":
            require(
                not self.extra_args,
                "harness.extra_args",
                self.extra_args,
                "[] with harness.name=command (put every argument in harness.argv)",
            )
