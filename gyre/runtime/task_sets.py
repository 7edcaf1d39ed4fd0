"""A training run's task sets: the pool each `Dispatch` draws a group's task from, and the held-out set of the
periodic greedy evaluation (docs/runtime.md, "Tasks and the held-out evaluation"; the config: `TasksConfig`,
docs/configuration.md).

- Training tasks: `tasks.task_dir` (a directory of task directories in the task format, docs/tasks.md), or, when
  it is empty, `tasks.num_demo_tasks` problems of the bundled demo family generated from `tasks.demo` and the run's
  seed into `<run dir>/tasks/train`.
- Held-out problems: the demo family's, `tasks.num_held_out` of them from another seed, every expression of the
  training pool left out (held-out problems are never trained on); ids `held-out-<seed>-<i>`.

Contract: `load_task_sets` raises `TaskSetError` (a ValueError, one line naming the field) for a task directory
that is missing, empty or holds no task that loads (a task that does not load is logged once, naming its file, and
skipped); a task directory of held-out tasks in the general task format
is refused the same way, since this runtime evaluates held-out problems of the demo family only (its greedy
player, `gyre.tasks.demo.warm_start.evaluate_greedy_model`, plays the demo's tool protocol without a harness).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from gyre.config.tasks import TasksConfig
from gyre.tasks.demo import DemoProblem, generate_demo_tasks, make_demo_problems
from gyre.tasks.spec import TASK_FILE, Task, load_tasks

log = logging.getLogger(__name__)

__all__ = ["HELD_OUT_PREFIX", "TaskSetError", "TaskSets", "load_task_sets"]

HELD_OUT_PREFIX = "held-out"
HELD_OUT_SEED_OFFSET = 1_000_003  # the held-out problems' seed: the run's seed plus this (a prime, as the warm start's)
TRAIN_DIR = "tasks/train"  # under the run directory: the generated demo pool


class TaskSetError(ValueError):
    """The configured tasks cannot be loaded (one line naming the field and what is wrong)."""


@dataclass(frozen=True)
class TaskSets:
    train: list[Task]
    held_out: list[DemoProblem]  # empty: no held-out evaluation


def _load_dir(field: str, directory: str) -> list[Task]:
    """The tasks under `directory` (`gyre.tasks.spec.load_tasks`). A task that cannot be loaded (a bad task.toml, a
    duplicate id) is logged once as a warning naming its file and skipped: it never stops the run, unless no task
    is left."""
    root = Path(directory)
    if not root.is_dir():
        raise TaskSetError(f"{field}={directory!r}: not a directory (expected a directory of task directories)")
    try:
        tasks, errors = load_tasks(root)
    except OSError as error:
        raise TaskSetError(f"{field}={directory!r}: cannot be read: {error}") from None
    for error in errors:
        log.warning("%s: skipped %s", field, error)
    if not tasks:
        if errors:
            raise TaskSetError(f"{field}={directory!r}: no task loads ({len(errors)} refused; the first: {errors[0]})")
        raise TaskSetError(f"{field}={directory!r}: holds no task directory (none has a {TASK_FILE}; docs/tasks.md)")
    return tasks


def load_task_sets(config: TasksConfig, run_dir: Path, *, seed: int) -> TaskSets:
    """The run's training tasks and held-out problems (module docstring)."""
    if config.uses_demo:
        out_dir = run_dir / TRAIN_DIR
        if out_dir.is_dir() and any(out_dir.iterdir()):
            train = _load_dir("tasks.task_dir", str(out_dir))  # a rerun in the same run directory
        else:
            train = generate_demo_tasks(config.num_demo_tasks, seed, out_dir, config=config.demo)
    else:
        train = _load_dir("tasks.task_dir", config.task_dir)
    if config.held_out_dir:
        raise TaskSetError(
            f"tasks.held_out_dir={config.held_out_dir!r}: held-out task directories are not evaluated by this "
            "runtime yet (the greedy evaluation plays demo problems); leave it empty for the demo family's held-out "
            "problems, or set tasks.eval_every=0"
        )
    held_out: list[DemoProblem] = []
    if config.evaluates:
        trained = {task.prompt for task in train}
        demo = dataclasses.replace(config.demo, id_prefix=HELD_OUT_PREFIX)
        held_seed = seed + HELD_OUT_SEED_OFFSET
        # Draw more than needed, keep those whose prompt is not a training prompt, in order: deterministic.
        candidates = make_demo_problems(4 * config.num_held_out + 16, held_seed, demo)
        held_out = [p for p in candidates if p.prompt not in trained][: config.num_held_out]
        if len(held_out) < config.num_held_out:
            raise TaskSetError(
                f"tasks.num_held_out={config.num_held_out}: only {len(held_out)} demo problems outside the training "
                "pool could be drawn (tasks.demo allows too few distinct problems); lower it"
            )
    return TaskSets(train=train, held_out=held_out)
