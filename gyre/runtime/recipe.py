"""What the runtime takes from a recipe (docs/recipes.md): a starting model, task sets, and the checks that only the
recipe can make.

The runtime trains "a model, task sets, a harness"; a recipe says where the first two come from when the config
does not name them (`model.model_dir`, `tasks.task_dir` empty): the demo recipe warm-starts the tiny model and
generates arithmetic problems. The app (`gyre.train`) resolves `recipe.name` to a `Recipe`
(`gyre.recipes.load_recipe`) and hands it to `run_training`; nothing under `gyre.runtime` imports a recipe
(tests/unit/test_package_layering.py).

A recipe must be picklable (a plainly launched job hands it to its worker processes): a module-level class with
plain fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gyre.config import TrainConfig
from gyre.tasks.spec import Task

__all__ = ["HeldOutSet", "Recipe", "RecipeError", "TaskSets"]


class RecipeError(ValueError):
    """The recipe cannot run as configured (one line naming the field and what to do); the program exits 2."""


@dataclass(frozen=True)
class HeldOutSet:
    """The held-out evaluation's problems and the player that runs them.

    `play(model, template, version=v)` plays every problem greedily with `model` (a `DecoderLM` nobody trains
    meanwhile) and its chat template, on a worker thread without an event loop, and returns a report with at least
    `episodes` and `success_rate` (`tool_call_rate`, `mean_score`, `failed` too where the player knows them);
    gyre.runtime.controller.held_out writes one line of it per policy version. `tasks`: held-out tasks in the task
    format, if the set is made of them (the harness preflight checks their evaluators too). A set of tasks without a
    player (`play=None`: a `tasks.held_out_dir`) is played by the runtime through the harness on the run's rollout
    engines (gyre.runtime.controller.held_out_engines)."""

    size: int
    play: Callable[..., dict] | None = None
    tasks: tuple[Task, ...] = ()


@dataclass(frozen=True)
class TaskSets:
    train: list[Task]
    held_out: HeldOutSet | None = None  # None: no held-out evaluation
    trusted: bool = False  # the recipe generated the tasks itself: the builtin harness may run them under our uid


class Recipe(Protocol):
    """A recipe: where the starting model and the tasks come from (module docstring)."""

    name: str

    def starting_model(self, cfg: TrainConfig, echo: Callable[[str], None]) -> Path:
        """The starting policy's HF-layout directory when `model.model_dir` is empty (built or cached here)."""
        ...

    def check(self, cfg: TrainConfig, model_dir: Path, context_limit: int) -> None:
        """Raise `RecipeError` for a config this recipe's tasks cannot run with on this model (e.g. an episode
        longer than the context limit), before anything starts."""
        ...

    def task_sets(self, cfg: TrainConfig, run_dir: Path) -> TaskSets:
        """The training tasks and the held-out set (`RecipeError` or `gyre.runtime.task_sets.TaskSetError`)."""
        ...
