"""The repo recipe (`gyre.recipes.repo`, docs/recipes.md "repo"): its shipped repositories import into task
directories through the SWE-style importer, every task starts with partial credit (some listed tests fail, some
pass) and reaches full credit once fixed (a real pytest run each: the family is solvable as shipped), and the recipe
refuses a warm start it does not have."""

from __future__ import annotations

import shutil

import pytest

from gyre.config import TrainConfig
from gyre.config.model import ModelConfig
from gyre.recipes.repo import RepoRecipe
from gyre.runtime.recipe import RecipeError
from gyre.tasks.evaluate import evaluate
from gyre.traj.outcomes import Validity

FIXES = {  # task -> (file, old, new): a correct fix
    "gyre-repo__wordcount": (
        "wordcount.py",
        "    for word in text.split():",
        '    import re\n\n    for word in re.findall(r"[a-z0-9\']+", text.lower()):',
    ),
    "gyre-repo__intervals": (
        "intervals.py",
        "    raise NotImplementedError",
        "    merged = []\n    for start, end in sorted(intervals):\n"
        "        if merged and start <= merged[-1][1]:\n            merged[-1][1] = max(merged[-1][1], end)\n"
        "        else:\n            merged.append([start, end])\n    return merged",
    ),
    "gyre-repo__roman": (
        "roman.py",
        'SYMBOLS = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]',
        'SYMBOLS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), '
        '(40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]',
    ),
    "gyre-repo__inventory": (
        "inventory.py",
        "        self.stock[item] = self.stock.get(item, 0) - quantity",
        "        if self.stock.get(item, 0) < quantity:\n            raise ValueError(item)\n"
        "        self.stock[item] -= quantity",
    ),
}


def test_the_shipped_tasks_import_and_a_rerun_loads_them_back(tmp_path):
    sets = RepoRecipe().task_sets(TrainConfig(), tmp_path / "run")
    assert sorted(t.id for t in sets.train) == sorted(FIXES)
    assert sets.held_out is None and not sets.trusted
    again = RepoRecipe().task_sets(TrainConfig(), tmp_path / "run")
    assert [t.id for t in again.train] == [t.id for t in sets.train]


@pytest.mark.parametrize("task_id", sorted(FIXES))
def test_each_task_starts_with_partial_credit_and_its_fix_passes(tmp_path, task_id):
    (task,) = [t for t in RepoRecipe().task_sets(TrainConfig(), tmp_path / "run").train if t.id == task_id]
    work = tmp_path / "work"
    shutil.copytree(task.task_dir / "workspace", work)
    start = evaluate(task, work)
    assert start.validity is Validity.VALID and 0 < start.score < 1, start
    name, old, new = FIXES[task_id]
    source = (work / name).read_text()
    assert old in source
    fixed = source.replace(old, new)
    if task_id.endswith("roman"):
        fixed = fixed.replace('    out = ""', '    if not 1 <= n <= 3999:\n        raise ValueError(n)\n    out = ""')
    (work / name).write_text(fixed)
    assert evaluate(task, work).score == 1.0


def test_the_repo_recipe_has_no_warm_start(tmp_path):
    with pytest.raises(RecipeError, match=r"model\.init='warm_start'"):
        RepoRecipe().starting_model(TrainConfig(model=ModelConfig(init="warm_start")), print)
