"""Held-out task directories (`tasks.held_out_dir`) played through the harness: the held-out set any recipe gets
when the config names one (docs/runtime.md, "Tasks and the held-out evaluation").

`load_held_out_tasks(cfg, train)` loads the directory (the first `tasks.num_held_out` tasks by id; 0: all), and
refuses one that shares a task id or a prompt with the training tasks (held-out tasks are never trained on);
`held_out_tasks(tasks)` makes their `HeldOutSet` (no player of its own: the runtime plays it on its engines).
`TaskPlayer.play(table, template, version=)`, on the caller's event loop: a proxy of its own over `table` (the
engines the caller chose; `gyre.runtime.controller.held_out_engines` gives it the run's rollout engines holding
the version evaluated) at temperature 0 (greedy; no records written), every held-out task run once with the run's
harness in the run's kind of sandbox (under `<run dir>/held_out_executions/v<version>/`), at most
`cluster.cell_capacity` at a time, each scored with its task's evaluator, as a training execution is
(`run_episode`). An execution passes when its reward reaches 1.0; the report: `episodes`, `success_rate`,
`mean_score` (an execution without a valid score counts 0) and `failed` (executions without a valid score).
`cancel` set stops every execution (the report is then not a measurement: the caller drops it).
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

__all__ = ["HELD_OUT_EXECUTIONS_DIR", "PASS_REWARD", "TaskPlayer", "held_out_tasks", "load_held_out_tasks"]

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


def held_out_tasks(tasks: list[Task]) -> HeldOutSet:
    """The held-out set of `tasks` (from `load_held_out_tasks`): played by the runtime on its engines (`TaskPlayer`)."""
    return HeldOutSet(size=len(tasks), tasks=tuple(tasks))


@dataclass(frozen=True)
class TaskPlayer:
    tasks: tuple[Task, ...]
    cfg: TrainConfig
    root: Path  # the held-out executions' directories: <root>/v<version>/<execution>
    model_dir: Path  # the starting model's: config.json (vocabulary, context) for the proxy

    async def play(self, table, template, *, version: int, cancel: asyncio.Event | None = None) -> dict:
        """Every task once through a proxy over `table` (a `gyre.proxy.routing.RoutingTable`), greedily (module
        docstring)."""
        from gyre.harness.episode import ProxyAccess, run_episode
        from gyre.proxy.start import start_proxy
        from gyre.runtime.job.harness_setup import harness_provisioning, make_runner, make_sandbox, task_limits
        from gyre.traj.outcomes import GroupOutcomes

        cfg = self.cfg
        greedy = replace(cfg.proxy.sampling, temperature=0.0)
        config = replace(cfg.proxy, sampling=greedy, port=0, record_routed_experts=False)
        root = self.root / f"v{version}"
        # an evaluation of this version cut off before a resume left its executions' directories
        await asyncio.to_thread(shutil.rmtree, root, ignore_errors=True)
        provisioning = await asyncio.to_thread(harness_provisioning, cfg.harness)
        running = asyncio.Semaphore(max(1, cfg.cluster.cell_capacity))
        proxy = registry = None

        async def one(task: Task, name: str) -> float | None:
            async with running:
                if cancel is not None and cancel.is_set():
                    return None
                session = registry.issue(name)
                try:
                    result = await run_episode(
                        task,
                        execution_id=name,
                        api_key=session.key,
                        runner=make_runner(cfg.harness, task, provisioning),
                        sandbox=sandbox,
                        proxy=access,
                        limits=task_limits(cfg.limits, task),
                        group=GroupOutcomes(1, [name]),
                        cancel_event=cancel,
                        on_harness_end=lambda run: registry.close(name),
                    )
                except Exception:  # one execution's failure is a missing score, never the evaluation's end
                    log.exception("held-out execution %s (task %s) failed", name, task.id)
                    return None
                return result.reward

        try:
            proxy, registry = await start_proxy(
                config, model_dir=self.model_dir, table=table, records_dir=None, template=template
            )
            sandbox = make_sandbox(cfg.harness, cfg.limits, root=root, trusted_tasks=False, run_dir=self.root)
            access = ProxyAccess(
                anthropic_base_url=proxy.url, openai_base_url=proxy.url + "/v1", model=cfg.proxy.model_names[0]
            )
            scores = await asyncio.gather(*(one(task, f"held-out-v{version}-{i}") for i, task in enumerate(self.tasks)))
        finally:
            if proxy is not None:
                await proxy.stop()
            if registry is not None:
                registry.close_all()
        valid = [s for s in scores if s is not None]
        n = max(1, len(scores))
        return {
            "episodes": len(scores),
            "success_rate": round(sum(s >= PASS_REWARD for s in valid) / n, 4),
            "mean_score": round(sum(valid) / n, 4),
            "failed": len(scores) - len(valid),
        }
