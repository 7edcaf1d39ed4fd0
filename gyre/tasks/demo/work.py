"""Slow executions of the demo family (docs/tasks.md, "Slow executions"): a check command that really runs a while.

With `tasks.demo.work.enabled`, each generated task carries a check command (`metadata.check_command`, run by the
builtin harness in the workspace after the final answer: `python -m gyre.tasks.demo.work`) and the work's shape
in its workspace (`.work.json`: the task's own factor, drawn once per task as a query's difficulty, and the
`DemoWorkConfig` numbers). The command draws its execution's durations from `$GYRE_EXECUTION_ID` (the same
execution of the same task and seed draws the same durations in every run), writes them to `.work/plan.json` and
sleeps until the execution has run its drawn duration (the harness's start-up and model calls count towards it,
from `$GYRE_HARNESS_STARTED`): the work costs wall time and no CPU, like a build waiting on its tools. The harness
budget stops a command that runs past it (a harness timeout: the answer already written is scored); the evaluator
(`score_after_evaluation`, a python evaluator in its own process) first takes the evaluation time of the plan,
and for the share of over-budget executions the workload sends to the overall timeout it never returns before
the overall budget ends it (a stuck evaluation: the execution is discarded). The rule that splits durations into
outcomes is the simulator's (`gyre.sim.durations.budgeted_duration`).

Stdlib only: this runs in every execution's process.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gyre.config.demo import DemoWorkConfig
from gyre.sim.durations import OVERALL_TIMEOUT, budgeted_duration
from gyre.tasks.demo.check import score_answer

__all__ = ["PLAN_FILE", "WORK_FILE", "WorkPlan", "plan_work", "score_after_evaluation", "task_work"]

WORK_FILE = ".work.json"  # in the task's workspace template
PLAN_FILE = ".work/plan.json"  # written by the check command into the execution's workspace
CHECK_COMMAND = "{python} -m gyre.tasks.demo.work"
EXECUTION_ENV = "GYRE_EXECUTION_ID"
STARTED_ENV = "GYRE_HARNESS_STARTED"  # set by the builtin harness (gyre.harness.builtin.__main__.STARTED_ENV)


@dataclass(frozen=True)
class WorkPlan:
    execution: str
    work_s: float  # how long the check command runs (the raw duration; the harness budget may stop it earlier)
    eval_s: float  # how long the evaluation takes before it scores
    outcome: str  # what the budgets make of it: completed | harness_timeout | overall_timeout


def task_work(config: DemoWorkConfig, seed: int, task_id: str) -> dict:
    """The `.work.json` of one task: the config's numbers, the seed and the task's own factor (log-normal)."""
    rng = random.Random(f"gyre.demo.work:{seed}:{task_id}")
    return {**asdict(config), "seed": seed, "task": task_id, "task_factor": math.exp(config.query_sigma * rng.gauss())}


def plan_work(work: dict, execution: str) -> WorkPlan:
    """The durations of `execution` on the task whose `.work.json` is `work`: pure and deterministic."""
    rng = random.Random(f"gyre.demo.work:{work['seed']}:{work['task']}:{execution}")
    raw = work["median_s"] * work["task_factor"] * math.exp(work["sigma"] * rng.gauss())
    eval_s = rng.expovariate(1.0 / work["eval_s"]) if work["eval_s"] > 0 else 0.0
    _, outcome = budgeted_duration(
        raw,
        eval_s,
        rng.random(),
        harness_s=work["harness_timeout_s"],
        overall_s=work["overall_timeout_s"],
        overall_share=work["overall_timeout_share"],
    )
    return WorkPlan(execution=execution, work_s=raw, eval_s=eval_s, outcome=outcome)


def _read_work(workspace: Path) -> dict:
    return json.loads((workspace / WORK_FILE).read_text(encoding="utf-8"))


def run_check(workspace: Path, execution: str, *, started_at: float | None = None) -> WorkPlan:
    """The check command's work: the plan written first (the evaluator reads it even after a stop), then the wait
    until the execution has run its drawn duration: `started_at` (Unix time) is when the harness started, whose
    start-up and model calls count towards it (without it, the whole duration is waited here)."""
    plan = plan_work(_read_work(workspace), execution)
    path = workspace / PLAN_FILE
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(asdict(plan)) + "\n", encoding="utf-8")
    elapsed = 0.0 if started_at is None else max(0.0, time.time() - started_at)
    time.sleep(max(0.0, plan.work_s - elapsed))
    return plan


def score_after_evaluation(workspace: Path, hidden_dir: Path | None) -> float:
    """The demo check after the plan's evaluation time; a plan the workload sends to the overall timeout waits
    past the task's overall budget, which ends it. No plan (the harness stopped before the check began): at once."""
    workspace = Path(workspace)
    plan_path = workspace / PLAN_FILE
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text(encoding="utf-8"))
        if plan["outcome"] == OVERALL_TIMEOUT:
            time.sleep(2 * _read_work(workspace)["overall_timeout_s"])
        time.sleep(plan["eval_s"])
    return score_answer(workspace, hidden_dir)


def main() -> int:
    execution = os.environ.get(EXECUTION_ENV)
    if not execution:
        print(f"gyre.tasks.demo.work: ${EXECUTION_ENV} is not set (the harness sets it)", file=sys.stderr)
        return 2
    started = os.environ.get(STARTED_ENV)
    try:
        started_at = float(started) if started else None
    except ValueError:
        started_at = None
    plan = run_check(Path.cwd(), execution, started_at=started_at)
    print(f"the execution ran its {plan.work_s:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
