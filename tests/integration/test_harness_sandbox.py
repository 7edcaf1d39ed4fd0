"""What each sandbox isolates, measured with real processes (the claims of docs/harness.md, "Sandboxes").

LocalSandbox with an own uid per execution (needs root; skipped with the reason otherwise):
- another execution's workspace (while it is prepared, and after it was released) and the run directory (a
  protected path with a checkpoint file of a known name) cannot be read; the own workspace and home can;
- another execution's environment (its key) cannot be read through /proc while it runs;
- a process that escaped the harness's process group (`setsid`) is killed by `release` (and by bwrap's pid
  namespace; without an own uid or bwrap it survives: asserted as the documented limit, then killed by PID);
- launch files are never written through a symlink a previous run planted;
- RLIMIT_NPROC holds (fork refused), and a binary in a private directory fails the start with a clear reason.
Without an own uid (isolate_user=False): another execution's workspace IS readable (the control of the probe).
Any LocalSandbox: RLIMIT_AS (a too large allocation fails, a small one works) and RLIMIT_FSIZE (SIGXFSZ).
BubblewrapSandbox (skipped where `bwrap` is missing): the run directory and other executions' workspaces do not
exist inside; the own workspace is writable; /tmp is private.

Time on 2 cores: ~5 s.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_harness_execution import marker, running

from gyre.config import ResourceLimits
from gyre.harness import sandbox as sandbox_module
from gyre.harness.execution import run_harness
from gyre.harness.protocol import ExecutionContext
from gyre.harness.runners import CodexRunner, CommandRunner
from gyre.harness.sandbox import BubblewrapSandbox, LocalSandbox
from gyre.traj.outcomes import CloseKind

MiB = 1 << 20
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="an own uid per execution needs root")
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)"
)


@pytest.fixture
def base():
    path = Path(tempfile.mkdtemp(prefix="gyre-sandbox-test-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["exec-wrapper", "preexec"])
def spawn(request, monkeypatch) -> str:
    """How a sandbox sets the limits and the own uid: util-linux's prlimit/setpriv exec'ing the harness (where they
    are installed), or the `preexec_fn` fallback (forced here as where they are missing)."""
    if request.param == "preexec":
        monkeypatch.setattr(sandbox_module, "exec_wrapper", lambda limits, uid: None)
    elif sandbox_module.exec_wrapper([(sandbox_module.resource.RLIMIT_NOFILE, 64)], 1) is None:
        pytest.skip("prlimit or setpriv (util-linux) is not installed: the preexec_fn path is the one used")
    return request.param


@pytest.fixture
def run_dir(base: Path) -> Path:
    """A controller run directory as Hydra leaves it (0755) with a checkpoint of a well-known name (0644)."""
    path = base / "run"
    (path / "checkpoints").mkdir(parents=True)
    (path / "checkpoints" / "step-1.pt").write_text("WEIGHTS")
    os.chmod(path, 0o755)
    return path


def context_of(sandbox: LocalSandbox, execution_id: str) -> ExecutionContext:
    dirs = sandbox.prepare(execution_id)
    return ExecutionContext(
        execution_id=execution_id,
        task_prompt="probe",
        workspace=dirs.workspace,
        home=dirs.home,
        log_dir=dirs.log_dir,
        anthropic_base_url="http://127.0.0.1:9",
        openai_base_url="http://127.0.0.1:9/v1",
        api_key=f"KEY-OF-{execution_id}",
        model="gyre",
    )


def sh(sandbox, context, script: str, timeout_s: float = 30.0, cancel_event=None):
    runner = CommandRunner(argv=["/bin/sh", "-c", script])
    return run_harness(
        runner, sandbox, context, harness_timeout_s=timeout_s, cancel_event=cancel_event, grace_period_s=0.5
    )


def probe_script(paths: list[Path]) -> str:
    """Print LEAK:<path> for every path it can read or list; ok:<path> otherwise; then prove its own dirs work."""
    lines = [
        f"(cat '{p}' 2>/dev/null || ls '{p}' 2>/dev/null) >/dev/null && echo LEAK:{p} || echo ok:{p}" for p in paths
    ]
    lines += ['echo mine > "$PWD/own.txt" && cat "$PWD/own.txt"', 'echo h > "$HOME/h.txt" && echo home-ok']
    return "; ".join(lines)


@needs_root
def test_own_uid_closes_other_workspaces_and_the_run_directory(base, run_dir, spawn):
    sandbox = LocalSandbox(root=base / "executions", protected_paths=[run_dir])
    victim = context_of(sandbox, "victim")
    (victim.workspace / "secret.txt").write_text("VICTIM-WORK")
    os.chown(victim.workspace / "secret.txt", sandbox.uid_of("victim"), sandbox.uid_of("victim"))
    attacker = context_of(sandbox, "attacker")
    assert sandbox.uid_of("attacker") != sandbox.uid_of("victim") != os.geteuid()
    targets = [victim.workspace / "secret.txt", victim.workspace, victim.home, run_dir / "checkpoints" / "step-1.pt"]
    targets += [run_dir, base / "executions"]

    result = asyncio.run(sh(sandbox, attacker, probe_script(targets)))
    out = result.stdout_path.read_text()
    assert result.close_kind is CloseKind.COMPLETED and "LEAK" not in out, out
    assert out.count("ok:") == len(targets)
    assert "mine" in out and "home-ok" in out  # its own workspace and home are writable

    asyncio.run(sh(sandbox, victim, "true"))  # the victim finished: its workspace is the controller's again
    assert (victim.workspace / "secret.txt").stat().st_uid == os.geteuid()
    later = context_of(sandbox, "later")
    out = asyncio.run(sh(sandbox, later, probe_script(targets[:2]))).stdout_path.read_text()
    assert "LEAK" not in out, out


def test_without_an_own_uid_or_bwrap_other_workspaces_are_open(base):
    """The control: the probe does detect a leak; LocalSandbox(isolate_user=False) isolates no files."""
    sandbox = LocalSandbox(root=base / "executions", isolate_user=False)
    victim = context_of(sandbox, "victim")
    (victim.workspace / "secret.txt").write_text("VICTIM-WORK")
    out = asyncio.run(sh(sandbox, context_of(sandbox, "attacker"), probe_script([victim.workspace / "secret.txt"])))
    assert f"LEAK:{victim.workspace / 'secret.txt'}" in out.stdout_path.read_text()


@needs_root
def test_own_uid_hides_a_running_executions_environment(base):
    sandbox = LocalSandbox(root=base / "executions")
    victim, attacker = context_of(sandbox, "victim"), context_of(sandbox, "attacker")

    async def scenario():
        stop = asyncio.Event()
        running = asyncio.ensure_future(sh(sandbox, victim, "sleep 1000", cancel_event=stop))
        await asyncio.sleep(0.5)
        probe = "grep -l KEY-OF-victim /proc/[0-9]*/environ 2>/dev/null; echo scanned"
        seen = await sh(sandbox, attacker, probe)
        stop.set()
        return seen, await asyncio.wait_for(running, timeout=10)

    seen, victim_run = asyncio.run(scenario())
    assert seen.stdout_path.read_text() == "scanned\n"
    assert victim_run.close_kind is CloseKind.CANCELLED


def escapee_left(sandbox: LocalSandbox, execution_id: str) -> list[int]:
    """Run a harness that starts a `setsid` child (out of its process group) and exits; the host pids left."""
    token = marker()
    context = context_of(sandbox, execution_id)
    result = asyncio.run(sh(sandbox, context, f"setsid sleep {token} & sleep 0.2"))
    assert result.close_kind is CloseKind.COMPLETED
    time.sleep(0.3)
    return running(token)


@needs_root
def test_release_kills_processes_that_left_the_process_group_under_an_own_uid(base):
    assert escapee_left(LocalSandbox(root=base / "executions"), "escaper") == []


@needs_bwrap
def test_bubblewraps_pid_namespace_ends_processes_that_left_the_process_group(base):
    assert escapee_left(BubblewrapSandbox(root=base / "executions"), "escaper") == []


def test_without_an_own_uid_a_process_that_left_the_group_survives(base):
    """The documented limit of LocalSandbox(isolate_user=False): a `setsid` escapee outlives the execution."""
    left = escapee_left(LocalSandbox(root=base / "executions", isolate_user=False), "escaper")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert len(left) == 1


OTHER_CONTROLLER = """
import asyncio
import sys
from pathlib import Path

from gyre.harness.protocol import ExecutionContext, LaunchSpec
from gyre.harness.sandbox import LocalSandbox

base, low, token = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sandbox = LocalSandbox(root=base / "other", lease_dir=base / "leases", uid_range=(low, low + 1))
dirs = sandbox.prepare("theirs")
context = ExecutionContext(
    execution_id="theirs", task_prompt="", workspace=dirs.workspace, home=dirs.home, log_dir=dirs.log_dir,
    anthropic_base_url="", openai_base_url="", api_key="", model="",
)
asyncio.run(sandbox.start(LaunchSpec(argv=("sleep", token), env={}), context, stdout=1, stderr=2))
print(sandbox.uid_of("theirs"), flush=True)
sys.stdin.read()  # its harness runs on until the test kills this controller
"""


@needs_root
def test_two_controllers_on_one_machine_never_share_a_uid(base):
    """Seen in CI (two pytest workers): both controllers handed out the same uid, and one's `release` (which kills
    every process of the uid) killed the other's harness mid-run. With leases the second skips the first's uid."""
    low = 6_190_000 + random.randrange(5_000) * 2
    token = marker()
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_CONTROLLER, str(base), str(low), token],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        theirs = int(other.stdout.readline())
        sandbox = LocalSandbox(root=base / "mine", lease_dir=base / "leases", uid_range=(low, low + 1))
        mine = []
        for i in range(3):  # each prepare and release reaps its uid: the other's, were it handed out here
            context = context_of(sandbox, f"mine-{i}")
            mine.append(sandbox.uid_of(context.execution_id))
            sandbox.release(context)
        assert theirs not in mine and set(mine) == {low, low + 1} - {theirs}
        assert running(token), "the other controller's harness was killed"
    finally:
        other.kill()
        other.wait(timeout=10)
        for pid in running(token):
            os.kill(pid, signal.SIGKILL)


@needs_root
def test_max_processes_and_a_private_binary(base, spawn):
    sandbox = LocalSandbox(root=base / "executions", limits=ResourceLimits(max_processes=8))
    context = context_of(sandbox, "forker")
    script = "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do sleep 30 & done; wait"
    result = asyncio.run(sh(sandbox, context, script, timeout_s=10))
    assert "fork" in result.stderr_path.read_text().lower() or "resource" in result.stderr_path.read_text().lower()

    private = base / "private"
    private.mkdir(mode=0o700)
    shutil.copy("/bin/true", private / "agent")
    runner = CommandRunner(argv=[str(private / "agent")])
    other = context_of(sandbox, "private")
    failed = asyncio.run(run_harness(runner, sandbox, other, harness_timeout_s=10))
    assert failed.close_kind is CloseKind.FAILED and str(private) in failed.reason and "own uid" in failed.reason


def test_address_space_and_file_size_limits(base, spawn):
    limits = ResourceLimits(address_space_bytes=1024 * MiB, file_size_bytes=1 * MiB)
    sandbox = LocalSandbox(root=base / "executions", limits=limits, isolate_user=False)
    alloc = (
        "import sys; a = bytearray(64 << 20); print('small ok', flush=True)\n"
        "try:\n    b = bytearray(2 << 30)\nexcept MemoryError:\n    print('refused'); sys.exit(7)\n"
    )
    runner = CommandRunner(argv=[sys.executable, "-c", alloc])
    result = asyncio.run(run_harness(runner, sandbox, context_of(sandbox, "alloc"), harness_timeout_s=30))
    assert result.exit_code == 7 and result.stdout_path.read_text() == "small ok\nrefused\n", result
    writer = CommandRunner(argv=[sys.executable, "-c", "open('big', 'wb').write(b'x' * (2 << 20))"])
    result = asyncio.run(run_harness(writer, sandbox, context_of(sandbox, "fsize"), harness_timeout_s=30))
    # CPython ignores SIGXFSZ, so the write fails with EFBIG instead of the signal killing it
    assert result.exit_code == 1 and "File too large" in result.stderr_path.read_text(), result
    assert (result.workspace / "big").stat().st_size == 1 * MiB


@needs_bwrap
def test_bubblewrap_shows_only_system_dirs_and_the_executions_own(base, run_dir):
    sandbox = BubblewrapSandbox(root=base / "executions")
    victim = context_of(sandbox, "victim")
    (victim.workspace / "secret.txt").write_text("VICTIM-WORK")
    (Path("/tmp") / f"{base.name}-host-tmp").write_text("HOST")
    attacker = context_of(sandbox, "attacker")
    targets = [victim.workspace / "secret.txt", run_dir / "checkpoints" / "step-1.pt", run_dir, Path("/root")]
    targets += [Path("/tmp") / f"{base.name}-host-tmp", Path("/work"), Path("/etc/shadow")]
    try:
        result = asyncio.run(sh(sandbox, attacker, probe_script(targets)))
    finally:
        (Path("/tmp") / f"{base.name}-host-tmp").unlink()
    out = result.stdout_path.read_text()
    assert result.close_kind is CloseKind.COMPLETED and "LEAK" not in out, out + result.stderr_path.read_text()
    assert out.count("ok:") == len(targets) and "mine" in out and "home-ok" in out


def test_launch_files_are_never_written_through_a_planted_symlink(base):
    """A re-run's home was the harness's: a link it left where a runner writes its config is refused (FAILED)."""
    sandbox = LocalSandbox(root=base / "executions")
    context = context_of(sandbox, "rerun")
    outside = base / "outside"
    outside.mkdir()
    (context.home / ".codex").symlink_to(outside)
    result = asyncio.run(run_harness(CodexRunner(binary="/bin/true"), sandbox, context, harness_timeout_s=10))
    assert result.close_kind is CloseKind.FAILED, result
    assert "symlink" in result.reason or "outside" in result.reason, result
    assert not (outside / "config.toml").exists()


@needs_root
def test_concurrent_prepares_get_distinct_uids_and_a_released_uid_is_not_reused_at_once(base):
    from concurrent.futures import ThreadPoolExecutor

    sandbox = LocalSandbox(root=base / "executions")
    ids = [f"e{i}" for i in range(6)]
    with ThreadPoolExecutor(len(ids)) as pool:  # run_episode prepares in worker threads, several at once
        list(pool.map(sandbox.prepare, ids))
    uids = [sandbox.uid_of(i) for i in ids]
    assert len(set(uids)) == len(ids) and None not in uids
    first = context_of(sandbox, "e0")
    sandbox.release(first)
    assert sandbox.uid_of("e0") is None
    sandbox.prepare("next")
    assert sandbox.uid_of("next") not in uids  # round robin
