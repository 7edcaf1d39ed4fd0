"""The arithmetic demo (docs/recipes.md, "demo"; the family: docs/warm-start.md): the tiny model warm-started on
the demo family, `tasks.num_demo_tasks` generated problems, and held-out problems played greedily without a
harness. The default recipe: the README's main command runs it.

- Starting model (`model.model_dir` empty): the warm-started tiny model (`model.init=warm_start`, cached), or its
  random init (`model.init=random`).
- Training tasks: `tasks.task_dir`, or (empty) `tasks.num_demo_tasks` problems generated from `tasks.demo` and the
  run's seed into `<run dir>/tasks/train` (a rerun in the same run directory loads them back).
- Held-out problems: `tasks.num_held_out` of the demo family from another seed, every expression of the training
  pool left out, ids `held-out-<seed>-<i>`, played by `evaluate_greedy_model` (the evaluation the warm start
  reports). With a `tasks.held_out_dir`, the runtime plays those tasks through the harness instead
  (`gyre.runtime.held_out_tasks`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

from gyre.config import TrainConfig
from gyre.runtime.recipe import HeldOutSet, RecipeError, TaskSets
from gyre.runtime.task_sets import TRAIN_DIR, load_task_dir
from gyre.tasks.demo import DEMO_MAX_TURNS, DemoProblem, generate_demo_tasks, make_demo_problems, system_prompt

__all__ = ["HELD_OUT_PREFIX", "DemoRecipe", "play_held_out"]

HELD_OUT_PREFIX = "held-out"
HELD_OUT_SEED_OFFSET = 1_000_003  # the held-out problems' seed: the run's seed plus this (a prime, as the warm start's)
MAX_NEW_TOKENS = 64  # as the warm start's report (evaluate_greedy's defaults): the curve starts at its figure
MAX_RUNNING = 32  # held-out episodes decoded at once


@dataclasses.dataclass(frozen=True)
class DemoRecipe:
    name: str = "demo"

    def starting_model(self, cfg: TrainConfig, echo: Callable[[str], None]) -> Path:
        if cfg.model.init == "warm_start":
            from gyre.tasks.demo.warm_start import read_meta, warm_start_dir

            echo("warm start of the tiny model (cached after the first run; a few minutes of CPU the first time) ...")
            model_dir = warm_start_dir(config=cfg.model.warm_start, seed=cfg.model.warm_start_seed)
            meta = read_meta(model_dir) or {}
            echo(f"warm start: {model_dir} (steps {meta.get('steps_done')}, final loss {meta.get('final_loss')})")
            return model_dir
        from gyre.models.tiny import tiny_model_dir

        return tiny_model_dir(spec=cfg.model.tiny)

    def check(self, cfg: TrainConfig, model_dir: Path, context_limit: int) -> None:
        """With `tasks.demo.context_words`, a demo episode's longest call fits the context limit: the system prompt
        with its notes (counted with the model's tokenizer) and every turn's new tokens. Otherwise the proxy would
        refuse every call and no step would train anything."""
        demo = cfg.tasks.demo
        if cfg.tasks.task_dir or not demo.context_words:
            return
        from gyre.models.decoder_config import read_config
        from gyre.models.tokenizer import load_tokenizer

        (problem,) = make_demo_problems(1, cfg.seed, demo)
        tokens = len(load_tokenizer(model_dir).encode(system_prompt(problem, demo)).ids)
        needed = tokens + DEMO_MAX_TURNS * cfg.proxy.sampling.max_new_tokens
        if needed > context_limit:
            max_positions = read_config(model_dir).max_position_embeddings
            raise RecipeError(
                f"tasks.demo.context_words={demo.context_words}: the system prompt with its notes is {tokens} tokens "
                f"of this model's tokenizer, {needed} with {DEMO_MAX_TURNS} turns of proxy.sampling.max_new_tokens="
                f"{cfg.proxy.sampling.max_new_tokens}, over the context limit {context_limit}: lower context_words, "
                f"or raise proxy.context_limit and packing.max_tokens_per_microstep (at most the model's "
                f"{max_positions})"
            )

    def task_sets(self, cfg: TrainConfig, run_dir: Path) -> TaskSets:
        tasks = cfg.tasks
        if tasks.task_dir:
            train = load_task_dir("tasks.task_dir", tasks.task_dir)
        else:
            out_dir = Path(run_dir) / TRAIN_DIR
            if out_dir.is_dir() and any(out_dir.iterdir()):
                train = load_task_dir("tasks.task_dir", out_dir)  # a rerun in the same run directory
            else:
                train = generate_demo_tasks(tasks.num_demo_tasks, cfg.seed, out_dir, config=tasks.demo)
        if tasks.eval_every == 0 or tasks.task_dir or tasks.held_out_dir:  # a held_out_dir: the runtime plays it
            return TaskSets(train=train, trusted=not tasks.task_dir)
        problems = held_out_problems(cfg, {task.prompt for task in train})
        play = functools.partial(play_held_out, problems)
        return TaskSets(train=train, held_out=HeldOutSet(size=len(problems), play=play), trusted=True)


def held_out_problems(cfg: TrainConfig, trained_prompts: set[str]) -> list[DemoProblem]:
    """`tasks.num_held_out` demo problems from the held-out seed whose prompt is no training prompt, in order."""
    demo = dataclasses.replace(cfg.tasks.demo, id_prefix=HELD_OUT_PREFIX)
    wanted = cfg.tasks.num_held_out
    candidates = make_demo_problems(4 * wanted + 16, cfg.seed + HELD_OUT_SEED_OFFSET, demo)
    problems = [p for p in candidates if p.prompt not in trained_prompts][:wanted]
    if len(problems) < wanted:
        raise RecipeError(
            f"tasks.num_held_out={wanted}: only {len(problems)} demo problems outside the training pool could be "
            "drawn (tasks.demo allows too few distinct problems); lower it"
        )
    return problems


def play_held_out(problems: list[DemoProblem], model, template, *, version: int = 0) -> dict:
    """Every problem played greedily by `model` with its chat template, as the builtin harness plays a demo task (at
    most `DEMO_MAX_TURNS` calls): the warm start's evaluation."""
    from gyre.tasks.demo.warm_start import evaluate_greedy_model

    return evaluate_greedy_model(
        model, template, problems, max_new_tokens=MAX_NEW_TOKENS, max_calls=DEMO_MAX_TURNS, max_running=MAX_RUNNING
    )
