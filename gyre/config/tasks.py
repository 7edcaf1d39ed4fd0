"""Config of a training run's task sets: what a group's task is drawn from, and the held-out set of the periodic
greedy evaluation.

A task set is either the bundled demo family (`gyre.tasks.demo`, generated from `demo` into the run directory) or
a directory of task directories in the task format (`gyre.tasks.spec`, docs/tasks.md). Pure: stdlib only; whether
the directories exist is checked when the run loads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.checks import require, require_int
from gyre.config.demo import DemoConfig


@dataclass(kw_only=True)
class TasksConfig:
    """The training tasks and the held-out tasks, and how often the held-out set is evaluated."""

    task_dir: str = ""
    """A directory of task directories (each with a task.toml, docs/tasks.md). Empty: the bundled demo family."""
    held_out_dir: str = ""
    """Held-out tasks of the greedy evaluation, in the same format. Empty with the demo family: held-out demo
    problems are generated (disjoint from the training pool); empty with a task_dir: no held-out set."""
    demo: DemoConfig = field(default_factory=DemoConfig)
    """The demo family's problems (used when task_dir or held_out_dir is empty)."""
    num_demo_tasks: int = 512
    """Demo family: problems in the training pool (each Dispatch draws one per group)."""
    num_held_out: int = 64
    """Held-out tasks evaluated: demo family, the problems generated; a held_out_dir, the first this many by id
    (0: all of them)."""
    eval_every: int = 5
    """Greedy held-out evaluation (temperature 0) before the first step, every this many steps and after the last;
    with a held_out_dir, of the published versions (on the rollout engines): publication v when a multiple of this
    lies in (the version published before it, v]; 0: never."""

    def __post_init__(self) -> None:
        for name in ("task_dir", "held_out_dir"):
            require(isinstance(getattr(self, name), str), f"tasks.{name}", getattr(self, name), "a directory path")
        require_int("tasks.num_demo_tasks", self.num_demo_tasks, ge=1)
        require_int("tasks.num_held_out", self.num_held_out, ge=0, note="0 = all of held_out_dir")
        require_int("tasks.eval_every", self.eval_every, ge=0, note="0 = never")
        if self.held_out_dir:
            require(
                _normalized(self.held_out_dir) != _normalized(self.task_dir),
                "tasks.held_out_dir",
                self.held_out_dir,
                "a directory other than tasks.task_dir (held-out tasks are never trained on)",
            )
        elif self.task_dir:
            require(
                self.eval_every == 0,
                "tasks.eval_every",
                self.eval_every,
                "0 when tasks.task_dir is set without tasks.held_out_dir (no held-out tasks to evaluate)",
            )
        if not self.held_out_dir:
            require(
                self.num_held_out >= 1 or self.eval_every == 0,
                "tasks.num_held_out",
                self.num_held_out,
                "an integer >= 1 for the demo family's held-out problems while tasks.eval_every > 0",
            )

    @property
    def uses_recipe_tasks(self) -> bool:
        """Training tasks come from the recipe (task_dir empty): the demo family's generated problems by default."""
        return not self.task_dir

    @property
    def evaluates(self) -> bool:
        """A held-out evaluation runs (a held-out set exists and eval_every > 0)."""
        return self.eval_every > 0 and (bool(self.held_out_dir) or self.uses_recipe_tasks)


def _normalized(path: str) -> str:
    """The path as written, without trailing slashes or a leading `./` (no filesystem access)."""
    path = path.rstrip("/") or "/"
    while path.startswith("./"):
        path = path[2:]
    return path
