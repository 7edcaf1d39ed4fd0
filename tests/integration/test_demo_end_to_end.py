"""The builtin harness solves bundled demo tasks through `gyre.serve` (issue 7's first acceptance item).

The warm-started tiny model (`gyre.tasks.demo.warm_start`, default settings, seed 0; cached under $GYRE_CACHE or
~/.cache/gyre; ~3.5 CPU minutes on first use) is served greedily by `python -m gyre.serve`; each demo task (a
product of two numbers: the warm start always reaches for the calculator there) runs as a real execution:
`run_episode` makes its workspace, starts `python -m gyre.harness.builtin` with the task's calculator tool and the
execution's key, then scores `answer.txt` with the task's hidden check. The proxy recorded every call with the
`main` role.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from serve_process import start_serve

from gyre.config import DemoConfig, ExecutionLimits
from gyre.harness.builtin.runner import BuiltinRunner
from gyre.harness.episode import ProxyAccess, run_episode
from gyre.harness.sandbox import LocalSandbox
from gyre.tasks.demo import generate_demo_tasks
from gyre.traj.outcomes import GroupOutcomes, Status
from gyre.traj.roles import Role, classifier_for
from gyre.traj.store import load_tree

pytestmark = pytest.mark.warm_start  # tests/conftest.py: ordered after the modules that do not need it
NUM_TASKS = 4


@pytest.fixture(scope="module")
def warm_model() -> Path:
    from gyre.config import WarmStartConfig
    from gyre.tasks.demo.warm_start import read_meta, warm_start_dir

    # The default settings, trained to the end however loaded the machine is (the budget is wall-clock time;
    # it is not part of the cache key, so this is the checkpoint `warm_start_dir()` gives everyone else too).
    model_dir = warm_start_dir(config=WarmStartConfig(max_minutes=60))
    assert read_meta(model_dir)["complete"], read_meta(model_dir)
    return model_dir


# One `gyre.serve` for the module (each start imports torch and loads the model: docs/testing.md, "Seventh round"),
# served greedily, with a key for each execution of every test here: the two backends' 4 each, then the slow
# executions' 3. Each test plays only its own executions and reads only their records.
KEYS_OF = {
    "anthropic": slice(0, NUM_TASKS),
    "openai": slice(NUM_TASKS, 2 * NUM_TASKS),
    "slow": slice(2 * NUM_TASKS, 2 * NUM_TASKS + 3),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory, warm_model):
    server = start_serve(
        tmp_path_factory.mktemp("serve") / "run",
        f"model_dir={warm_model}",
        f"executions={2 * NUM_TASKS + 3}",
        "proxy.sampling.temperature=0",
    )
    yield server
    server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["anthropic", "openai"])
def test_the_builtin_harness_solves_demo_tasks_through_gyre_serve(tmp_path, served, backend):
    tasks = generate_demo_tasks(NUM_TASKS, seed=11, out_dir=tmp_path / "tasks", config=DemoConfig(operators="*"))
    proxy = ProxyAccess(anthropic_base_url=served.anthropic_url, openai_base_url=served.openai_url, model="gyre")
    sandbox = LocalSandbox(root=tmp_path / "executions", isolate_user=False)
    limits = ExecutionLimits(harness_timeout_s=120, overall_timeout_s=240, grace_period_s=2)
    executions = sorted(served.keys)[KEYS_OF[backend]]
    group = GroupOutcomes(NUM_TASKS, executions)

    async def main():
        return await asyncio.gather(
            *(
                run_episode(
                    task,
                    execution_id=execution,
                    api_key=served.keys[execution],
                    runner=BuiltinRunner.for_task(task, backend=backend, max_turns=4),
                    sandbox=sandbox,
                    proxy=proxy,
                    limits=limits,
                    group=group,
                )
                for task, execution in zip(tasks, executions, strict=True)
            )
        )

    results = asyncio.run(main())
    details = [(r.task_id, r.status, r.reward, r.reason) for r in results]
    assert all(r.status is Status.VALID for r in results), details
    solved = [r for r in results if r.reward == 1.0]
    print(f"{backend}: solved {len(solved)} of {NUM_TASKS}: {details}")
    assert len(solved) >= NUM_TASKS // 2, details  # the warm start solves ~99% of products (docs/warm-start.md)
    classify = classifier_for("builtin")
    for result in solved:
        tree = load_tree(served.records / f"{result.execution_id}.jsonl")
        assert len(tree.calls) >= 2  # the calculator call, then the answer
        assert {classify(tree, leaf) for leaf in tree.leaves()} == {Role.MAIN}


@pytest.mark.slow
def test_slow_executions_spend_their_time_in_the_check_command_and_meet_both_budgets(tmp_path, served):
    """docs/tasks.md, "Slow executions": one execution of each outcome the workload shape gives, through the real
    harness and the proxy: the check command's time inside the harness, a harness timeout scored with the answer it
    left, a stuck evaluation discarded at the overall budget."""
    from gyre.config.demo import DemoWorkConfig
    from gyre.traj.outcomes import CloseKind

    # The budgets are the smallest that keep each outcome apart: the tiny model's few calls take a few seconds, so
    # a 15 s harness budget stops the harness in its 600 s check command, not before its answer is written.
    fixed = {"sigma": 0.0, "query_sigma": 0.0, "eval_s": 0.2}
    works = {
        "completed": DemoWorkConfig(enabled=True, median_s=4.0, harness_timeout_s=40, overall_timeout_s=60, **fixed),
        "harness_timeout": DemoWorkConfig(
            enabled=True, median_s=600, harness_timeout_s=15, overall_timeout_s=60, **fixed
        ),
        "overall_timeout": DemoWorkConfig(
            enabled=True, median_s=600, harness_timeout_s=15, overall_timeout_s=20, overall_timeout_share=1.0, **fixed
        ),
    }
    tasks = {
        kind: generate_demo_tasks(1, seed=5, out_dir=tmp_path / kind, config=DemoConfig(operators="*", work=work))[0]
        for kind, work in works.items()
    }
    proxy = ProxyAccess(anthropic_base_url=served.anthropic_url, openai_base_url=served.openai_url, model="gyre")
    sandbox = LocalSandbox(root=tmp_path / "executions", isolate_user=False)
    executions = dict(zip(works, sorted(served.keys)[KEYS_OF["slow"]], strict=True))
    group = GroupOutcomes(3, list(executions.values()))

    async def one(kind: str):
        task, execution = tasks[kind], executions[kind]
        started = time.monotonic()
        result = await run_episode(
            task,
            execution_id=execution,
            api_key=served.keys[execution],
            runner=BuiltinRunner.for_task(task, backend="openai"),
            sandbox=sandbox,
            proxy=proxy,
            limits=ExecutionLimits(harness_timeout_s=120, overall_timeout_s=240, grace_period_s=2),
            group=group,
        )
        return result, time.monotonic() - started

    async def main():
        return await asyncio.gather(*(one(kind) for kind in works))

    results = dict(zip(works, asyncio.run(main()), strict=True))
    details = {kind: (r.status, r.reward, r.reason, round(s, 1)) for kind, (r, s) in results.items()}
    print(f"slow executions: {details}")
    completed, seconds = results["completed"]
    assert (
        completed.status is Status.VALID and group.execution(executions["completed"]).close_kind is CloseKind.COMPLETED
    )
    transcript = "".join(
        p.read_text() for p in (tmp_path / "executions").rglob("transcript.jsonl") if executions["completed"] in str(p)
    )
    assert '"check_end"' in transcript and seconds >= 4.0 + 0.2, details  # the drawn 4 s, then the evaluation
    timed_out, seconds = results["harness_timeout"]
    assert timed_out.status is Status.VALID, details  # scored with what it left (its answer, written before the check)
    assert group.execution(executions["harness_timeout"]).close_kind is CloseKind.HARNESS_TIMEOUT, details
    assert 15 <= seconds < 35, details
    stuck, seconds = results["overall_timeout"]
    assert stuck.status is Status.EXCLUDED and 20 <= seconds < 30, details  # stopped at the budget, not waited for
