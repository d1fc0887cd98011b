"""The architecture registry's rules: each family's rule reaches the recipe calibration gets.

One test per registry entry, on the family's tiny zoo model (built once a session, shared with
the architecture matrix, tests/matrix/test_architectures.py, which also runs DeepSeek-V3's: its
model takes ~10 s to build). A user's own ignore list and mappings are kept, never replaced.
"""

from __future__ import annotations

import pytest
from support.family_rules import assert_rule_reaches_the_recipe

from compressflow.registries.architectures import ARCHITECTURES


@pytest.mark.parametrize(
    "family",
    # DeepSeek-V3's zoo model takes ~10 s to build, the rest together less: it runs in
    # tests/matrix/test_architectures.py.
    [family for family in sorted(ARCHITECTURES) if family != "deepseek_v3"],
)
def test_each_family_rule_changes_the_recipe_as_written(zoo_root, family):
    """One test per registry entry: the rule reaches the recipe that calibration gets."""
    assert_rule_reaches_the_recipe(zoo_root, family)
