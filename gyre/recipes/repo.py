"""Repository tasks for Claude Code and Codex (docs/recipes.md, "repo"): a failing test suite the agent must make
pass, scored by pytest with partial credit.

- Starting model (`model.model_dir` empty): the tiny model of `model.tiny` at random init (`conf/recipe/repo.yaml`:
  one layer, 131,072 positions, so Claude Code's ~48K-token first call fits and its prefill takes seconds on a CPU),
  biased toward ending its turn (`gyre.models.tiny.bias_toward_end_of_turn`: a random-init model never ends one,
  every answer runs to the output cap, and both CLIs report a capped answer as an error). It learns nothing useful:
  the recipe's CPU run proves the loop (calls recorded, rows trained); a real run names a `model.model_dir`.
- Training tasks: `tasks.task_dir`, or the shipped family (`gyre/recipes/repo_tasks/rows.jsonl`: small Python
  repositories, SWE-style rows whose hidden tests are the snapshot's own `tests/`, copied back over the agent's edits
  before scoring) imported into `<run dir>/tasks/train` with the SWE-style importer
  (`gyre.tasks.swe_import`); a rerun in the same run directory loads them back.
- Held-out: a `tasks.held_out_dir` (played through the harness by the runtime); none of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre.config import TrainConfig
from gyre.runtime.recipe import RecipeError, TaskSets
from gyre.runtime.task_sets import TRAIN_DIR, load_task_dir

__all__ = ["SHIPPED_ROWS", "RepoRecipe"]

SHIPPED_ROWS = Path(__file__).resolve().parent / "repo_tasks" / "rows.jsonl"


@dataclass(frozen=True)
class RepoRecipe:
    name: str = "repo"

    def starting_model(self, cfg: TrainConfig, echo: Callable[[str], None]) -> Path:
        if cfg.model.init != "random":
            raise RecipeError(
                f"model.init={cfg.model.init!r}: the repo recipe has no warm start (that is the demo's); set "
                "model.model_dir to your model, or model.init=random for the tiny model's random init"
            )
        from gyre.models.tiny import tiny_model_dir

        echo(
            f"starting model: the tiny model at random init, {cfg.model.tiny.max_position_embeddings} positions, "
            "biased toward ending its turn"
        )
        return tiny_model_dir(spec=cfg.model.tiny, ends_turns=True)

    def check(self, cfg: TrainConfig, model_dir: Path, context_limit: int) -> None:
        pass

    def task_sets(self, cfg: TrainConfig, run_dir: Path) -> TaskSets:
        if cfg.tasks.task_dir:
            return TaskSets(train=load_task_dir("tasks.task_dir", cfg.tasks.task_dir))
        out_dir = Path(run_dir) / TRAIN_DIR
        if not (out_dir.is_dir() and any(out_dir.iterdir())):
            from gyre.tasks.swe_import import SweImportError, import_rows, read_rows

            try:
                import_rows(read_rows(SHIPPED_ROWS), out_dir)
            except SweImportError as error:  # a broken installation: the shipped rows are checked by the tests
                raise RecipeError(f"recipe=repo: its shipped tasks do not import: {error}") from None
        return TaskSets(train=load_task_dir("tasks.task_dir", out_dir))
