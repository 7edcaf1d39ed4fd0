"""Evaluators inside the execution's sandbox (`gyre.harness.evaluation.SandboxHost`), measured with real processes.

The "agent's code" is a `solution.sh` the evaluator runs from the workspace (as pytest runs the agent's modules).
It tries to read the controller's run directory (a checkpoint) and another execution's workspace and prints how
many it read as the score, so a score of 0 means the evaluator's process was closed to both:
- LocalSandbox as root: the evaluator runs as a uid of its own (not the harness's, not root): 0/2; the control,
  the same evaluation as the controller's user (`LocalHost`), reads both: 2/2;
- a daemon the evaluated code leaves in a session of its own is gone after the evaluation;
- an evaluator the evaluation's uid cannot execute is a FAILED attempt naming the closed directory, not a score;
- BubblewrapSandbox: neither path exists inside; the hidden files do;
- a host closed without running anything (an inline checker, a planted `hidden_dest`) returns its uid, and paths
  that would bind the executions' root or the run directory are not bound;
- BubblewrapSandbox runs `{python} -m pytest` and a python evaluator with the controller's Python bound read-only;
- an evaluator past its time limit inside the sandbox is PENDING (not a score) and stopped;
- `run_episode` evaluates in the sandbox by default, and as the controller's user with `evaluate_in_sandbox=False`;
  the harness, under its own uid, may rewrite the task's template files (the controller copied them in as root).

Needs root (own uids) or bwrap; skipped with the reason otherwise. Time on 2 cores: ~3 s.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from gyre.config import ExecutionLimits
from gyre.harness.episode import ProxyAccess, run_episode
from gyre.harness.evaluation import SandboxHost, sandboxed_evaluation
from gyre.harness.runners import CommandRunner
from gyre.harness.sandbox import BubblewrapSandbox, LocalSandbox
from gyre.tasks.evaluate import evaluate, workspace_digest
from gyre.tasks.spec import load_task, prepare_workspace
from gyre.traj.outcomes import GroupOutcomes, Status, Validity

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="an own uid per evaluation needs root")
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)"
)
PROXY = ProxyAccess(anthropic_base_url="http://127.0.0.1:9", openai_base_url="http://127.0.0.1:9/v1", model="gyre")


@pytest.fixture
def base():
    path = Path(tempfile.mkdtemp(prefix="gyre-eval-sandbox-test-", dir="/tmp"))
    os.chmod(path, 0o711)  # other uids may pass through to their own execution directories
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def secrets(base: Path) -> list[Path]:
    """A checkpoint in the controller's run directory (0755/0644 as Hydra leaves it) and another execution's work."""
    run_dir = base / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-1.pt").write_text("WEIGHTS")
    os.chmod(run_dir, 0o755)
    other = base / "executions" / "victim" / "workspace"
    other.mkdir(parents=True)
    (other / "answer.txt").write_text("VICTIM-WORK")
    os.chmod(other, 0o700)  # as LocalSandbox.prepare leaves an execution's workspace
    return [run_dir / "checkpoints" / "step-1.pt", other / "answer.txt"]


def stealing_solution(targets: list[Path], extra: str = "") -> str:
    """The agent's code: prints `<how many of targets it read>/<len(targets)>` and its uid on stderr."""
    lines = ["n=0"]
    lines += [f"cat '{t}' >/dev/null 2>&1 && n=$((n+1))" for t in targets]
    lines += ['echo "uid=$(id -u)" >&2', f'echo "$n/{len(targets)}"', extra]
    return "\n".join(lines) + "\n"


def make_task(root: Path, solution: str, *, evaluator: str = "/bin/sh") -> Path:
    """A task whose template workspace holds the agent's `solution.sh`; the evaluator runs it via hidden/check.sh."""
    task_dir = root / "task"
    (task_dir / "workspace").mkdir(parents=True)
    (task_dir / "workspace" / "solution.sh").write_text(solution)
    (task_dir / "hidden").mkdir()
    (task_dir / "hidden" / "check.sh").write_text('test -f "$GYRE_HIDDEN_DIR/check.sh" || exit 3\nsh ./solution.sh\n')
    (task_dir / "task.toml").write_text(
        'id = "steal"\nprompt = "p"\n[timeouts]\nharness_s = 20\noverall_s = 40\n'
        f'[evaluator]\nkind = "command"\ncommand = ["{evaluator}", "{{hidden}}/check.sh"]\n'
        'score = "fraction"\ntimeout_s = 20\n'
    )
    return task_dir


@needs_root
def test_an_own_uid_closes_the_run_directory_and_other_workspaces_to_the_evaluated_code(base, secrets):
    task = load_task(make_task(base, stealing_solution(secrets)))
    workspace = prepare_workspace(task, base / "preserved")
    sandbox = LocalSandbox(root=base / "executions", protected_paths=[base / "run"])

    result = sandboxed_evaluation(task, workspace, sandbox, "attacker")
    assert result.validity is Validity.VALID and result.score == 0.0 and result.detail == "0/2", result.log
    uid = int(result.log.split("uid=")[1].split()[0])
    assert uid not in (0, os.geteuid()) and sandbox.uid_range[0] <= uid <= sandbox.uid_range[1]
    evaluation = "attacker.evaluate"
    assert not (sandbox.root / evaluation).exists() and sandbox.uid_of(evaluation) is None  # removed, uid returned
    assert result.artifact == workspace_digest(workspace)  # the preserved work is untouched

    control = evaluate(task, workspace)  # the controller's user: the probe does read both
    assert control.valid and control.detail == "2/2" and "uid=0" in control.log


@needs_root
def test_a_daemon_the_evaluated_code_leaves_is_killed(base):
    token = "987653"
    task = load_task(make_task(base, f"setsid sleep {token} >/dev/null 2>&1 &\necho 1/1\n"))
    workspace = prepare_workspace(task, base / "preserved")
    result = sandboxed_evaluation(task, workspace, LocalSandbox(root=base / "executions"), "attacker")
    assert result.valid and result.detail == "1/1", result.log
    time.sleep(0.2)
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"sleep\0{token}".encode() in (proc / "cmdline").read_bytes():
                    left.append(int(proc.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    assert left == []


@needs_root
def test_an_evaluator_the_own_uid_cannot_execute_is_a_failed_attempt(base):
    private = base / "private"
    private.mkdir(mode=0o700)
    shutil.copy("/bin/sh", private / "sh")
    task = load_task(make_task(base, "echo 1/1\n", evaluator=str(private / "sh")))
    sandbox = LocalSandbox(root=base / "executions")
    result = sandboxed_evaluation(task, prepare_workspace(task, base / "w"), sandbox, "attacker")
    assert result.validity is Validity.FAILED and result.score == 0.0
    assert "could not start" in result.detail and str(private) in result.detail


@needs_bwrap
def test_bubblewrap_shows_the_evaluator_only_its_copy_and_the_hidden_files(base, secrets):
    task = load_task(make_task(base, stealing_solution(secrets)))
    workspace = prepare_workspace(task, base / "preserved")
    result = sandboxed_evaluation(task, workspace, BubblewrapSandbox(root=base / "executions"), "attacker")
    assert result.validity is Validity.VALID and result.detail == "0/2", result.log  # check.sh found hidden/


@needs_root
def test_run_episode_evaluates_inside_the_sandbox_unless_told_otherwise(base, secrets):
    task_dir = make_task(base, "echo 0/1\n")  # the template's solution; the harness writes the stealing one
    task = load_task(task_dir)
    stealing = stealing_solution(secrets)
    script = f"id -u > harness-uid; cat > solution.sh <<'EOF'\n{stealing}EOF\n"
    runner = CommandRunner(argv=("/bin/sh", "-c", script))
    sandbox = LocalSandbox(root=base / "executions", protected_paths=[base / "run"])
    limits = ExecutionLimits(harness_timeout_s=20, overall_timeout_s=40, grace_period_s=0.5)

    async def episode(execution_id: str, in_sandbox: bool):
        group = GroupOutcomes(1, [execution_id])
        common = {"runner": runner, "sandbox": sandbox, "proxy": PROXY, "limits": limits, "group": group}
        return await run_episode(
            task,
            execution_id=execution_id,
            api_key="k",
            evaluate_in_sandbox=in_sandbox,
            evaluation_retry_s=0.1,
            **common,
        )

    sandboxed = asyncio.run(episode("e-sandboxed", True))
    assert sandboxed.status is Status.VALID and sandboxed.reward == 0.0, sandboxed.evaluations
    # the harness (its own uid) could replace the task's template file, and the evaluation ran it as another uid
    assert sandboxed.evaluations[0].detail == "0/2" and "uid=" in sandboxed.evaluations[0].log
    evaluation_uid = int(sandboxed.evaluations[0].log.split("uid=")[1].split()[0])
    harness_uid = int((sandbox.root / "e-sandboxed" / "workspace" / "harness-uid").read_text())
    assert len({evaluation_uid, harness_uid, 0}) == 3  # neither root nor the uid the harness just released
    assert sandbox.uid_of("e-sandboxed") is None and sandbox.uid_of("e-sandboxed.evaluate") is None
    trusted = asyncio.run(episode("e-trusted", False))
    assert trusted.status is Status.VALID and trusted.reward == 1.0, trusted.evaluations  # the control: 2/2


@needs_root
def test_a_host_closed_unused_returns_its_uid_and_private_paths_are_not_bound(base):
    sandbox = LocalSandbox(root=base / "executions", protected_paths=[base / "run"])
    host = SandboxHost(sandbox, "inline", ro_paths=[base, base / "run" / "checkpoints", Path("/usr/share")])
    assert sandbox.uid_of("inline.evaluate") is not None
    assert host.ro_paths == (Path("/usr/share"),)  # base holds the executions' root, run/ is protected
    host.close()
    assert sandbox.uid_of("inline.evaluate") is None and not host.directory.exists()


CALC_TESTS = """\
from calc import add, sub

def test_add():
    assert add(2, 3) == 5

def test_sub():
    assert sub(5, 3) == 2
"""
CHECKER = """\
def score(workspace, hidden):
    answer = (workspace / "answer.txt").read_text().strip()
    return 1.0 if answer == (hidden / "expected.txt").read_text().strip() else 0.0
"""


@needs_bwrap
@pytest.mark.parametrize("kind", ["pytest", "python"])
def test_bubblewrap_runs_the_controllers_python_for_pytest_and_python_evaluators(tmp_path, base, kind):
    task_dir = tmp_path / "task"
    (task_dir / "workspace").mkdir(parents=True)
    (task_dir / "hidden").mkdir()
    if kind == "pytest":
        (task_dir / "workspace" / "calc.py").write_text("def add(a, b):\n    return a + b\n\nsub = None\n")
        (task_dir / "hidden" / "test_calc.py").write_text(CALC_TESTS)
        evaluator = (
            'kind = "command"\ncommand = ["{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "{hidden}"]\n'
            "timeout_s = 60"
        )
    else:
        (task_dir / "workspace" / "answer.txt").write_text("42\n")
        (task_dir / "hidden" / "expected.txt").write_text("42\n")
        (task_dir / "checker.py").write_text(CHECKER)
        evaluator = 'kind = "python"\nfunction = "checker:score"\ntimeout_s = 60'
    (task_dir / "task.toml").write_text(f'id = "bw"\nprompt = "p"\n[evaluator]\n{evaluator}\n')
    task = load_task(task_dir)
    sandbox = BubblewrapSandbox(root=base / "executions")
    result = sandboxed_evaluation(task, prepare_workspace(task, base / "w"), sandbox, "attacker")
    assert result.validity is Validity.VALID, (result.detail, result.log)
    assert result.score == (0.5 if kind == "pytest" else 1.0), (result.detail, result.log)


def test_an_evaluator_past_its_time_limit_in_the_sandbox_is_pending_not_a_score(base):
    task_dir = make_task(base, "sleep 30\n")
    toml = (task_dir / "task.toml").read_text().replace("timeout_s = 20", "timeout_s = 1")
    (task_dir / "task.toml").write_text(toml)
    task = load_task(task_dir)
    sandbox = LocalSandbox(root=base / "executions", isolate_user=False)
    started = time.monotonic()
    result = sandboxed_evaluation(task, prepare_workspace(task, base / "w"), sandbox, "slow")
    assert result.validity is Validity.PENDING and result.score == 0.0 and "timed out after 1 s" in result.detail
    assert time.monotonic() - started < 10  # stopped at its limit (SIGTERM, then SIGKILL a second later)
