"""The architecture registry's rules: each family's rule reaches the recipe calibration gets.

One test per registry entry, on the family's tiny zoo model (built once a session, shared with
the architecture matrix, tests/matrix/test_architectures.py, which also runs DeepSeek-V3's: its
model takes ~10 s to build). A user's own ignore list and mappings are kept, never replaced.
"""

from __future__ import annotations

import pytest
from support.models import ARCHITECTURE_NAMES, model_type

from compressflow.demo.zoo import build_tiny, model_class
from compressflow.params import ModelArgs, RecipeArgs
from compressflow.recipes.render import render
from compressflow.registries.architectures import ARCHITECTURES
from compressflow.tasks.adapt_recipe import adapt_recipe
from compressflow.tasks.fetch_model import fetch


@pytest.mark.parametrize(
    "family",
    # DeepSeek-V3's zoo model takes ~10 s to build, the rest together less: it runs in
    # tests/matrix/test_architectures.py.
    [family for family in sorted(ARCHITECTURES) if family != "deepseek_v3"],
)
def test_each_family_rule_changes_the_recipe_as_written(zoo_root, family):
    """One test per registry entry: the rule reaches the recipe that calibration gets."""
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
    # A user's own ignore list and mappings are kept, never replaced.
    own = render(RecipeArgs(recipe="W8A8", recipe_args={"ignore": ["lm_head", "re:.*mine$"]}))
    assert "re:.*mine$" in adapt_recipe.fn(own, fetched).yaml
