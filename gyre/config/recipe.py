"""Config of a training run's recipe: where its starting model and tasks come from when `model.model_dir` and
`tasks.task_dir` are empty (docs/recipes.md). Pure: stdlib only; the name is resolved by the app
(`gyre.recipes.load_recipe`)."""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config.checks import require


@dataclass(kw_only=True)
class RecipeConfig:
    """The recipe a run uses (the Hydra group `recipe=<name>`, conf/recipe/, sets it with its other settings)."""

    name: str = "demo"
    """demo (the arithmetic demo, the default), or package.module:Attribute for a recipe of your own
    (docs/recipes.md)."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and self.name.strip() == self.name and bool(self.name),
            "recipe.name",
            self.name,
            "a recipe name or package.module:Attribute",
        )
