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
    name = next(n for n in ARCHITECTURE_NAMES if model_type(build_tiny(n, zoo_root)) == family)
    rule = ARCHITECTURES[family]
    fetched = fetch(ModelArgs(model_id=str(zoo_root / name), model_class=model_class(name)))
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
