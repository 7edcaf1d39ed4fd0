"""Recipes (`gyre.recipes`, docs/recipes.md): `load_recipe` resolves a registered name or `package.module:Attribute`
and refuses anything else with one line naming `recipe.name`; the demo recipe's task sets are the demo family's
(generated, trusted, a held-out set disjoint from the training prompts) and it refuses what its player cannot
evaluate. The runtime importing no recipe is tests/unit/test_package_layering.py."""

from __future__ import annotations

import pickle
import sys

import pytest

from gyre.config import TrainConfig
from gyre.config.demo import DemoConfig
from gyre.config.tasks import TasksConfig
from gyre.recipes import RECIPES, load_recipe
from gyre.recipes.demo import DemoRecipe

OWN = """
from dataclasses import dataclass
from gyre.runtime.recipe import TaskSets


@dataclass(frozen=True)
class Mine:
    name: str = "mine"

    def starting_model(self, cfg, echo):
        return "/models/mine"

    def check(self, cfg, model_dir, context_limit):
        pass

    def task_sets(self, cfg, run_dir):
        return TaskSets(train=[])


class Half:
    def starting_model(self, cfg, echo):
        return "/models/half"


nothing = None
"""


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    (tmp_path / "my_recipes.py").write_text(OWN)
    (tmp_path / "bad_recipes.py").write_text("raise RuntimeError('this module fails on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_recipes"
    for name in ("my_recipes", "bad_recipes"):
        sys.modules.pop(name, None)


def test_registered_names_and_a_recipe_of_ones_own_load(own_module):
    assert set(RECIPES) >= {"demo"}
    assert load_recipe("demo") == DemoRecipe()
    mine = load_recipe(f"{own_module}:Mine")  # a class: instantiated with no arguments
    assert mine.name == "mine" and mine.starting_model(None, print) == "/models/mine"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("nope", "expected one of ['demo'"),
        ("gyre.nowhere:Recipe", "cannot import gyre.nowhere"),
        ("bad_recipes:Recipe", "this module fails on import"),
        ("my_recipes:Missing", "my_recipes has no Missing"),
        ("my_recipes:Half", "lacks check, task_sets"),
        ("my_recipes:nothing", "my_recipes has no nothing"),  # None: not a recipe
        (":Mine", "not a recipe"),
    ],
)
def test_what_is_not_a_recipe_is_one_line_naming_the_field(own_module, name, says):
    with pytest.raises(ValueError, match=r"recipe\.name=") as error:
        load_recipe(name)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_the_demo_recipe_generates_trusted_tasks_and_a_disjoint_held_out_set(tmp_path):
    cfg = TrainConfig(tasks=TasksConfig(num_demo_tasks=12, num_held_out=5, demo=DemoConfig(operators="*")))
    recipe = pickle.loads(pickle.dumps(DemoRecipe()))  # a plainly launched job pickles it to its workers
    sets = recipe.task_sets(cfg, tmp_path / "run")
    assert len(sets.train) == 12 and sets.trusted
    assert (tmp_path / "run" / "tasks" / "train").is_dir()
    assert sets.held_out is not None and sets.held_out.size == 5
    held_prompts = {p.prompt for p in sets.held_out.play.args[0]}
    assert held_prompts.isdisjoint({task.prompt for task in sets.train})
    again = recipe.task_sets(cfg, tmp_path / "run")  # a rerun in the same run directory loads them back
    assert [t.id for t in again.train] == [t.id for t in sets.train]
    assert [p.id for p in again.held_out.play.args[0]] == [p.id for p in sets.held_out.play.args[0]]


def test_the_demo_recipe_loads_a_task_dir_untrusted_without_held_out(tmp_path):
    generated = DemoRecipe().task_sets(TrainConfig(tasks=TasksConfig(num_demo_tasks=3, eval_every=0)), tmp_path / "a")
    task_dir = tmp_path / "a" / "tasks" / "train"
    cfg = TrainConfig(tasks=TasksConfig(task_dir=str(task_dir), eval_every=0))
    sets = DemoRecipe().task_sets(cfg, tmp_path / "b")
    assert [t.id for t in sets.train] == [t.id for t in generated.train]
    assert not sets.trusted and sets.held_out is None


def test_with_a_held_out_dir_the_demo_recipe_leaves_the_held_out_set_to_the_runtime(tmp_path):
    cfg = TrainConfig(tasks=TasksConfig(num_demo_tasks=3, held_out_dir=str(tmp_path / "held")))
    sets = DemoRecipe().task_sets(cfg, tmp_path / "run")
    assert len(sets.train) == 3 and sets.trusted and sets.held_out is None
