"""The architecture registry's one check per family, shared by the unit tier (every family but
DeepSeek-V3) and the matrix (DeepSeek-V3, whose zoo model takes ~10 s to build)."""

from __future__ import annotations

from pathlib import Path

from compressflow.demo.zoo import build_tiny, model_class
from compressflow.params import ModelArgs, RecipeArgs
from compressflow.recipes.render import render
from compressflow.registries.architectures import ARCHITECTURES
from compressflow.tasks.adapt_recipe import adapt_recipe
from compressflow.tasks.fetch_model import fetch
from support.models import ARCHITECTURE_NAMES, model_type


def assert_rule_reaches_the_recipe(zoo_root: Path, family: str) -> None:
    """The family's rule reaches the recipe that calibration gets; a user's own ignore list and
    mappings are kept, never replaced."""
    # The zoo names each model after its model_type: build that one alone, not every model
    # before it in the zoo to read their types (5 s of the unit tier).
    assert family in ARCHITECTURE_NAMES, f"the zoo has no {family} model to test its rule on"
    assert model_type(build_tiny(family, zoo_root)) == family
    rule = ARCHITECTURES[family]
    fetched = fetch(ModelArgs(model_id=str(zoo_root / family), model_class=model_class(family)))
    adapted = adapt_recipe.fn(render(RecipeArgs(recipe="W8A8")), fetched)
    assert adapted.architecture == family
    for pattern in rule.ignore:
        assert pattern in adapted.yaml
    if rule.no_smoothquant:
        assert "SmoothQuantModifier" not in adapted.modifiers
        assert any("SmoothQuant removed" in note for note in adapted.notes)
    elif rule.smoothquant:
        assert "mappings" in adapted.yaml
    own = render(RecipeArgs(recipe="W8A8", recipe_args={"ignore": ["lm_head", "re:.*mine$"]}))
    assert "re:.*mine$" in adapt_recipe.fn(own, fetched).yaml
