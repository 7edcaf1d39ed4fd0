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

For a caller that schedules executions itself (the training runtime): `on_harness_end` is called exactly once per
episode, before the evaluation, for every way a harness ends (and with None when it never ran); an error it raises
comes back after the episode as `HarnessEndError` with the result. `cancel_event` stops the harness, stops a running
evaluator (sandboxed or as the controller's user: its process is gone when the episode returns) or a wait to retry
one, and the outcome is CANCELLED; set after the episode ended, it changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from pathlib import Path

import pytest

from gyre.config import ExecutionLimits
from gyre.harness.episode import HarnessEndError, ProxyAccess, run_episode, run_group
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
    pathlib.Path("started").write_text("")
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


# An evaluator that says where it runs (its pid, in a file outside the sandbox) and then takes two minutes.
SLOW_CHECK = """
import os, pathlib, time
pathlib.Path({marker!r}).write_text(str(os.getpid()))
time.sleep(120)
print("1/1")
"""


def make_task(root: Path, *, harness_s: float, overall_s: float, check: str = CHECK):
    task_dir = root / "task"
    (task_dir / "workspace").mkdir(parents=True)
    (task_dir / "hidden").mkdir()
    (task_dir / "hidden" / "check.py").write_text(check)
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


def one_episode(task, script: Path, sandbox, limits, group, mode: str, **options):
    """`run_episode` of execution "e" whose harness runs in `mode`."""
    runner = ModeRunner(script, {"e": mode})
    common = {"sandbox": sandbox, "proxy": PROXY, "limits": limits, "group": group}
    return run_episode(task, execution_id="e", api_key="k", runner=runner, **common, **options)


async def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_harness_end_is_reported_once_before_the_evaluation_for_every_way_a_harness_ends(tmp_path, setup):
    script, sandbox = setup
    task = make_task(tmp_path, harness_s=2.0, overall_s=60.0)
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=120, grace_period_s=1.0)
    modes = {"finish": "finish", "stall": "stall", "cancelled": "finish"}
    ids = [*modes, "missing", "no/workspace"]  # a "/" in the id: the sandbox cannot make its directories
    group = GroupOutcomes(4, ids)
    reports: dict[str, list] = {e: [] for e in ids}

    def on_harness_end(execution, run):
        outcome = group.execution(execution)
        reports[execution].append((run, outcome.status, len(outcome.evaluations)))

    async def main():
        runner = ModeRunner(script, modes)
        missing = CommandRunner(argv=("/nonexistent/agent", "{prompt}"))
        cancelled = asyncio.Event()
        cancelled.set()  # before the start: the harness never runs
        common = {"sandbox": sandbox, "proxy": PROXY, "limits": limits, "group": group}

        def episode(execution, runner, **extra):
            report = functools.partial(on_harness_end, execution)
            return run_episode(task, execution_id=execution, api_key="k", runner=runner, on_harness_end=report, **extra)

        return await asyncio.wait_for(
            asyncio.gather(
                episode("finish", runner, **common),
                episode("stall", runner, **common),
                episode("cancelled", runner, cancel_event=cancelled, **common),
                episode("missing", missing, **common),
                episode("no/workspace", runner, **common),
            ),
            timeout=60,
        )

    results = dict(zip(ids, asyncio.run(main()), strict=True))
    kinds = {e: (calls[0][0].close_kind if calls[0][0] is not None else None) for e, calls in reports.items()}
    assert {e: len(calls) for e, calls in reports.items()} == dict.fromkeys(ids, 1)  # exactly once each
    assert kinds == {
        "finish": CloseKind.COMPLETED,
        "stall": CloseKind.HARNESS_TIMEOUT,
        "cancelled": CloseKind.CANCELLED,
        "missing": CloseKind.FAILED,
        "no/workspace": None,  # no harness ran
    }
    # reported before anything of the evaluation: the close not yet recorded, no evaluation
    assert all(status is Status.OPEN and count == 0 for calls in reports.values() for _, status, count in calls)
    assert all(calls[0][0] is results[e].run for e, calls in reports.items())  # the run the result carries
    assert results["finish"].reward == 1.0 and results["stall"].status is Status.VALID  # evaluated after the report
    assert results["cancelled"].status is Status.CANCELLED and results["no/workspace"].status is Status.PLACEHOLDER


def test_an_error_in_on_harness_end_comes_back_after_the_episode_with_its_result(tmp_path, setup):
    script, sandbox = setup
    task = make_task(tmp_path, harness_s=60.0, overall_s=120.0)
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=120, grace_period_s=1.0)
    group = GroupOutcomes(1, ["e"])
    calls = []

    def on_harness_end(run):
        calls.append(run)
        raise RuntimeError("the caller's bug")

    async def main():
        episode = one_episode(task, script, sandbox, limits, group, "finish", on_harness_end=on_harness_end)
        return await asyncio.wait_for(episode, timeout=60)

    with pytest.raises(HarnessEndError, match="'e' raised") as raised:
        asyncio.run(main())
    assert len(calls) == 1 and isinstance(raised.value.__cause__, RuntimeError)
    result = raised.value.result  # the episode ran to its end: evaluated and recorded
    assert result.status is Status.VALID and result.reward == 1.0 and len(result.evaluations) == 1
    assert group.ready and group.rewards() == {"e": 1.0}


def test_cancel_while_the_harness_runs_stops_it(tmp_path, setup):
    script, sandbox = setup
    task = make_task(tmp_path, harness_s=120.0, overall_s=180.0)
    limits = ExecutionLimits(harness_timeout_s=300, overall_timeout_s=600, grace_period_s=1.0)
    group = GroupOutcomes(1, ["e"])
    runs = []

    async def main():
        cancel = asyncio.Event()
        episode = asyncio.ensure_future(
            one_episode(task, script, sandbox, limits, group, "slow", cancel_event=cancel, on_harness_end=runs.append)
        )
        await wait_for(lambda: (sandbox.root / "e" / "workspace" / "started").exists(), "the harness's start")
        assert not runs  # still running
        cancel.set()
        cancelled_at = time.monotonic()
        result = await asyncio.wait_for(episode, timeout=30)
        return result, time.monotonic() - cancelled_at

    result, stop_s = asyncio.run(main())
    assert stop_s < 10.0  # SIGTERM, not its 120 s budget
    assert result.run.close_kind is CloseKind.CANCELLED and result.status is Status.CANCELLED
    assert runs == [result.run] and result.evaluations == [] and group.execution("e").status is Status.CANCELLED


@pytest.mark.parametrize("in_sandbox", [True, False], ids=["sandboxed", "as-controller"])
def test_cancel_while_the_evaluator_runs_stops_it_and_cancels_the_outcome(tmp_path, setup, in_sandbox):
    script, sandbox = setup
    marker = tmp_path / "evaluator.pid"
    task = make_task(tmp_path, harness_s=60.0, overall_s=300.0, check=SLOW_CHECK.format(marker=str(marker)))
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=300, grace_period_s=1.0)
    group = GroupOutcomes(1, ["e"])
    runs = []

    async def main():
        cancel = asyncio.Event()
        episode = asyncio.ensure_future(
            one_episode(
                task,
                script,
                sandbox,
                limits,
                group,
                "finish",
                cancel_event=cancel,
                on_harness_end=runs.append,
                evaluate_in_sandbox=in_sandbox,
            )
        )
        await wait_for(lambda: marker.exists() and marker.read_text(), "the evaluator's start")
        pid = int(marker.read_text())
        assert alive(pid) and len(runs) == 1 and group.execution("e").status is Status.AWAITING
        cancel.set()
        cancelled_at = time.monotonic()
        result = await asyncio.wait_for(episode, timeout=60)
        return result, pid, time.monotonic() - cancelled_at

    result, pid, stop_s = asyncio.run(main())
    assert stop_s < 10.0  # not the evaluator's 120 s
    assert not alive(pid)  # stopped before the episode returned
    assert runs == [result.run] and result.run.close_kind is CloseKind.COMPLETED
    assert result.status is Status.CANCELLED and result.reward is None and result.evaluations == []  # discarded
    outcome = group.execution("e")
    assert outcome.status is Status.CANCELLED and outcome.close_kind is CloseKind.COMPLETED and not outcome.evaluations
    assert group.ready and group.members == () and group.rewards() == {}  # cancelled: outside the group's N


@pytest.mark.parametrize("in_sandbox", [True, False], ids=["sandboxed", "as-controller"])
def test_an_evaluation_still_running_when_the_overall_budget_ends_is_stopped_then(tmp_path, setup, in_sandbox):
    """A hung evaluator does not hold its execution (and so its group) past the overall budget: EXCLUDED at it."""
    script, sandbox = setup
    marker = tmp_path / "evaluator.pid"
    task = make_task(tmp_path, harness_s=2.0, overall_s=4.0, check=SLOW_CHECK.format(marker=str(marker)))
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=300, grace_period_s=1.0)
    group = GroupOutcomes(1, ["e"])
    started = time.monotonic()
    result = asyncio.run(one_episode(task, script, sandbox, limits, group, "finish", evaluate_in_sandbox=in_sandbox))
    elapsed = time.monotonic() - started
    assert 4.0 <= elapsed < 12.0  # the budget, not the evaluator's 120 s (nor its own 30 s timeout)
    assert not alive(int(marker.read_text()))  # stopped before the episode returned
    assert result.status is Status.EXCLUDED and result.reward is None and result.evaluations == []
    assert "overall budget of 4 s ran out during the evaluation" in result.reason


def test_cancel_while_waiting_to_retry_a_failed_evaluation_cancels_the_outcome(tmp_path, setup):
    script, sandbox = setup
    task = make_task(tmp_path, harness_s=60.0, overall_s=300.0)
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=300, grace_period_s=1.0)
    group = GroupOutcomes(1, ["e"])

    async def main():
        cancel = asyncio.Event()
        episode = asyncio.ensure_future(
            one_episode(
                task, script, sandbox, limits, group, "crash-evaluator", cancel_event=cancel, evaluation_retry_s=120.0
            )
        )
        await wait_for(lambda: len(group.execution("e").evaluations) == 1, "the first evaluation")
        cancel.set()
        cancelled_at = time.monotonic()
        result = await asyncio.wait_for(episode, timeout=30)
        return result, time.monotonic() - cancelled_at

    result, stop_s = asyncio.run(main())
    assert stop_s < 5.0  # not the 120 s retry wait, nor the budget
    assert result.status is Status.CANCELLED and len(result.evaluations) == 1 and not result.evaluations[0].valid
    outcome = group.execution("e")
    assert outcome.status is Status.CANCELLED and len(outcome.evaluations) == 1  # its log kept


def test_cancel_after_the_episode_ended_changes_nothing(tmp_path, setup):
    script, sandbox = setup
    task = make_task(tmp_path, harness_s=60.0, overall_s=120.0)
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=120, grace_period_s=1.0)
    group = GroupOutcomes(1, ["e"])

    async def main():
        cancel = asyncio.Event()
        episode = one_episode(task, script, sandbox, limits, group, "finish", cancel_event=cancel)
        result = await asyncio.wait_for(episode, timeout=60)
        before = (group.execution("e").status, group.execution("e").evaluations)
        cancel.set()
        await asyncio.sleep(0.3)  # anything still listening would act now
        return result, before

    result, before = asyncio.run(main())
    assert result.status is Status.VALID and result.reward == 1.0
    assert (group.execution("e").status, group.execution("e").evaluations) == before and group.rewards() == {"e": 1.0}
