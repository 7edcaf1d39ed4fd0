"""Held-out task directories (`tasks.held_out_dir`) played through the harness: the held-out set any recipe gets
when the config names one (docs/runtime.md, "Tasks and the held-out evaluation").

`load_held_out_tasks(cfg, train)` loads the directory (the first `tasks.num_held_out` tasks by id; 0: all), and
refuses one that shares a task id or a prompt with the training tasks (held-out tasks are never trained on);
`held_out_tasks(cfg, run_dir, tasks, model_dir)` makes their `HeldOutSet`.
`TaskPlayer` is its `HeldOutSet.play`: on the evaluator's worker thread, with its own event loop, it serves the policy
snapshot from an in-process native engine behind a proxy of its own at temperature 0 (greedy; no records written),
runs every held-out task once with the run's harness in the run's kind of sandbox (under
`<run dir>/held_out_executions/v<version>/`), at most `cluster.cell_capacity` at a time, and scores each with its
task's evaluator, as a training execution is (`run_episode`). An execution passes when its reward reaches 1.0; the
report: `episodes`, `success_rate`, `mean_score` (an execution without a valid score counts 0) and
`failed` (executions without a valid score).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from gyre.config import TrainConfig
from gyre.runtime.recipe import HeldOutSet
from gyre.runtime.task_sets import TaskSetError, load_task_dir
from gyre.tasks.spec import Task

log = logging.getLogger(__name__)

__all__ = ["PASS_REWARD", "TaskPlayer", "held_out_tasks", "load_held_out_tasks"]

HELD_OUT_EXECUTIONS_DIR = "held_out_executions"


PASS_REWARD = 1.0  # an execution passed when its reward reaches this (a full score: the demo check's)


def load_held_out_tasks(cfg: TrainConfig, train: list[Task]) -> list[Task]:
    """The tasks of `tasks.held_out_dir` (module docstring); `TaskSetError` for a directory that cannot be used or a
    task that is also a training task."""
    tasks = load_task_dir("tasks.held_out_dir", cfg.tasks.held_out_dir)
    if cfg.tasks.num_held_out:
        tasks = tasks[: cfg.tasks.num_held_out]
    trained_ids, trained_prompts = {t.id for t in train}, {t.prompt for t in train}
    for task in tasks:
        if task.id in trained_ids or task.prompt in trained_prompts:
            what = f"id {task.id!r}" if task.id in trained_ids else f"the prompt of task {task.id!r}"
            raise TaskSetError(
                f"tasks.held_out_dir={cfg.tasks.held_out_dir!r}: {what} is also a training task's (held-out tasks are "
                "never trained on); remove it from one of the two directories"
            )
    return tasks


def held_out_tasks(cfg: TrainConfig, run_dir: Path, tasks: list[Task], model_dir: Path) -> HeldOutSet:
    """The held-out set that plays `tasks` (from `load_held_out_tasks`) with `TaskPlayer`."""
    player = TaskPlayer(tasks=tuple(tasks), cfg=cfg, root=Path(run_dir) / HELD_OUT_EXECUTIONS_DIR, model_dir=model_dir)
    return HeldOutSet(size=len(tasks), play=player, tasks=tuple(tasks))


@dataclass(frozen=True)
class TaskPlayer:
    tasks: tuple[Task, ...]
    cfg: TrainConfig
    root: Path  # the held-out executions' directories: <root>/v<version>/<execution>
    model_dir: Path  # the starting model's: config.json (vocabulary, context) for the proxy

    def __call__(self, model, template, *, version: int = 0) -> dict:
        return asyncio.run(self._play(model, template, version))

    async def _play(self, model, template, version: int) -> dict:
        from gyre.engine.native import NativeEngine
        from gyre.harness.episode import ProxyAccess
        from gyre.proxy.routing import RoutingTable
        from gyre.proxy.start import start_proxy
        from gyre.runtime.job.harness_setup import harness_provisioning, make_sandbox

        cfg = self.cfg
        engine = NativeEngine(model, max_running=cfg.engine.max_running)
        table = RoutingTable()
        table.add_engine("held-out", engine)
        greedy = replace(cfg.proxy.sampling, temperature=0.0)
        config = replace(cfg.proxy, sampling=greedy, port=0, record_routed_experts=False)
        proxy = registry = None
        try:
            proxy, registry = await start_proxy(
                config, model_dir=self.model_dir, table=table, records_dir=None, template=template
            )
            root = self.root / f"v{version}"
            shutil.rmtree(root, ignore_errors=True)  # an evaluation of this version cut off before a resume
            sandbox = make_sandbox(cfg.harness, cfg.limits, root=root, trusted_tasks=False, run_dir=self.root)
            access = ProxyAccess(
                anthropic_base_url=proxy.url, openai_base_url=proxy.url + "/v1", model=cfg.proxy.model_names[0]
            )
            running = asyncio.Semaphore(max(1, cfg.cluster.cell_capacity))
            provisioning = harness_provisioning(cfg.harness)
            scores = await asyncio.gather(
                *(
                    self._one(task, f"held-out-v{version}-{i}", registry, sandbox, access, running, provisioning)
                    for i, task in enumerate(self.tasks)
                )
            )
        finally:
            if proxy is not None:
                await proxy.stop()
            if registry is not None:
                registry.close_all()
            await engine.close()
        valid = [s for s in scores if s is not None]
        n = max(1, len(scores))
        return {
            "episodes": len(scores),
            "success_rate": round(sum(s >= PASS_REWARD for s in valid) / n, 4),
            "mean_score": round(sum(valid) / n, 4),
            "failed": len(scores) - len(valid),
        }

    async def _one(self, task: Task, name: str, registry, sandbox, access, running, provisioning) -> float | None:
        from gyre.harness.episode import run_episode
        from gyre.runtime.job.harness_setup import make_runner, task_limits
        from gyre.traj.outcomes import GroupOutcomes

        async with running:
            session = registry.issue(name)
            try:
                result = await run_episode(
                    task,
                    execution_id=name,
                    api_key=session.key,
                    runner=make_runner(self.cfg.harness, task, provisioning),
                    sandbox=sandbox,
                    proxy=access,
                    limits=task_limits(self.cfg.limits, task),
                    group=GroupOutcomes(1, [name]),
                    on_harness_end=lambda run: registry.close(name),
                )
            except Exception:  # one execution's failure is a missing score, never the evaluation's end
                log.exception("held-out execution %s (task %s) failed", name, task.id)
                return None
            return result.reward
