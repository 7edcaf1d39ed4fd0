"""Timeout semantics end to end (paper: "Partial scoring"): real harness processes, real evaluator processes.

One group of a task whose hidden check counts "ok" lines in `progress.txt` (score = ok / 4). The harness is a small
Python script run by the `command` runner; what it does depends on its execution:
- finishes: 4 ok -> COMPLETED, score 1.0;
- stalls after 2 ok past its harness budget -> HARNESS_TIMEOUT, the preserved work scores a valid 0.5;
- leaves a workspace the evaluator crashes on -> retried on the same state, never valid -> EXCLUDED once the
  overall budget ends (no reward, not a zero);
- cannot start (its binary is missing) -> FAILED: the zero-reward placeholder;
and the group stays complete (N rewards or placeholders, the excluded one None). A second group oversamples:
once N executions have valid outcomes the surplus one still running is cancelled.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from gyre.config import ExecutionLimits
from gyre.harness.episode import ProxyAccess, run_episode, run_group
from gyre.harness.runners import CommandRunner
from gyre.harness.sandbox import LocalSandbox
from gyre.tasks.spec import load_task
from gyre.traj.outcomes import CloseKind, GroupOutcomes, Status

HARNESS = """
import pathlib, sys, time
mode = pathlib.Path("mode").read_text().strip() if pathlib.Path("mode").exists() else sys.argv[1]
progress = pathlib.Path("progress.txt")
if mode == "finish":
    progress.write_text("ok\\nok\\nok\\nok\\n")
elif mode == "stall":
    progress.write_text("ok\\nok\\n")
    time.sleep(1000)
elif mode == "crash-evaluator":
    progress.write_text("ok\\n")
    pathlib.Path("crash").write_text("x")
elif mode == "slow":
    time.sleep(1000)
"""

CHECK = """
import pathlib, sys
workspace = pathlib.Path(sys.argv[1])
if (workspace / "crash").exists():
    raise SystemExit("the evaluator cannot read this workspace")
lines = (workspace / "progress.txt").read_text().split() if (workspace / "progress.txt").exists() else []
print(f"{lines.count('ok')}/4")
"""

PROXY = ProxyAccess(anthropic_base_url="http://127.0.0.1:9", openai_base_url="http://127.0.0.1:9/v1", model="gyre")


def make_task(root: Path, *, harness_s: float, overall_s: float):
    task_dir = root / "task"
    (task_dir / "workspace").mkdir(parents=True)
    (task_dir / "hidden").mkdir()
    (task_dir / "hidden" / "check.py").write_text(CHECK)
    (task_dir / "task.toml").write_text(
        'id = "progress"\nprompt = "finish"\n'
        f"[timeouts]\nharness_s = {harness_s}\noverall_s = {overall_s}\n"
        '[evaluator]\nkind = "command"\ncommand = ["{python}", "{hidden}/check.py", "{workspace}"]\n'
        'score = "fraction"\ntimeout_s = 30\n'
    )
    return load_task(task_dir)


class ModeRunner(CommandRunner):
    """The command runner with a per-execution mode file written into the fresh workspace (the harness reads it)."""

    def __init__(self, script: Path, modes: dict[str, str]):
        super().__init__(argv=(sys.executable, str(script), "{prompt}"))
        self.modes = modes

    def launch_spec(self, context):
        spec = super().launch_spec(context)
        return type(spec)(
            argv=spec.argv,
            env=spec.env,
            files={**spec.files, context.workspace / "mode": self.modes[context.execution_id]},
            stdin=spec.stdin,
        )


@pytest.fixture
def setup(tmp_path: Path):
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    sandbox = LocalSandbox(root=tmp_path / "executions", isolate_user=False)
    return script, sandbox


@pytest.mark.slow
def test_timeouts_evaluator_failures_and_total_failures_keep_the_group_complete(tmp_path, setup):
    script, sandbox = setup
    task = make_task(tmp_path, harness_s=2.0, overall_s=6.0)
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=120, grace_period_s=1.0)
    modes = {"e-finish": "finish", "e-stall": "stall", "e-crash": "crash-evaluator"}
    ids = [*modes, "e-missing"]
    group = GroupOutcomes(4, ids)

    async def main():
        runner = ModeRunner(script, modes)
        missing = CommandRunner(argv=("/nonexistent/agent", "{prompt}"))
        common = {"sandbox": sandbox, "proxy": PROXY, "limits": limits, "group": group, "evaluation_retry_s": 0.5}
        return await asyncio.gather(
            *(run_episode(task, execution_id=e, api_key=f"k-{e}", runner=runner, **common) for e in modes),
            run_episode(task, execution_id="e-missing", api_key="k", runner=missing, **common),
        )

    started = time.monotonic()
    finish, stall, crash, missing = asyncio.run(main())
    elapsed = time.monotonic() - started

    assert finish.run.close_kind is CloseKind.COMPLETED and finish.status is Status.VALID and finish.reward == 1.0
    assert stall.run.close_kind is CloseKind.HARNESS_TIMEOUT  # killed at its 2 s budget, work preserved
    assert stall.status is Status.VALID and stall.reward == 0.5  # partial scoring: a valid reward
    assert crash.run.close_kind is CloseKind.COMPLETED
    assert len(crash.evaluations) >= 2 and not any(e.valid for e in crash.evaluations)  # retried, never a score
    assert crash.status is Status.EXCLUDED and crash.reward is None  # excluded at the 6 s budget, not a zero
    assert missing.run.close_kind is CloseKind.FAILED and "/nonexistent/agent" in missing.reason
    assert missing.status is Status.PLACEHOLDER and missing.reward == 0.0  # the group stays complete
    assert group.ready and group.rewards() == {"e-finish": 1.0, "e-stall": 0.5, "e-crash": None, "e-missing": 0.0}
    assert 6.0 <= elapsed < 30.0  # the excluded one waited for its budget, nothing waited much longer
    assert (sandbox.root / "e-stall" / "workspace" / "progress.txt").read_text() == "ok\nok\n"  # preserved


@pytest.mark.slow
def test_oversampling_cancels_the_surplus_once_the_group_is_ready(tmp_path, setup):
    script, sandbox = setup
    task = make_task(tmp_path, harness_s=120.0, overall_s=180.0)
    limits = ExecutionLimits(harness_timeout_s=300, overall_timeout_s=600, grace_period_s=1.0)
    modes = {"g0": "finish", "g1": "finish", "g2": "slow"}  # N = 2, one surplus that would run for ages

    async def main():
        return await run_group(
            task,
            group_size=2,
            execution_ids=list(modes),
            api_keys=["k0", "k1", "k2"],
            runner=ModeRunner(script, modes),
            sandbox=sandbox,
            proxy=PROXY,
            limits=limits,
        )

    started = time.monotonic()
    group, results = asyncio.run(main())
    assert time.monotonic() - started < 60.0  # not the surplus's 120 s harness budget
    assert [r.status for r in results] == [Status.VALID, Status.VALID, Status.CANCELLED]
    assert results[2].run.close_kind is CloseKind.CANCELLED
    assert group.ready and group.members == ("g0", "g1") and group.surplus == ("g2",)
