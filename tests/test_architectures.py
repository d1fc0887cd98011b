"""The architecture matrix: the presets on tiny models of the families people bring.

Every cell either publishes a model that passed verification, and that this test reloads from
the published folder and compares with the base model itself, or refuses before calibrating with
an error that names the field and the fix. No cell may publish a broken model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset
from PIL import Image
from reload_check import assert_published_model_matches_base

from compressflow.data.local_text import python_docs
from compressflow.demo.zoo import VISION_BUILDERS, ZOO, build_tiny, model_class
from compressflow.errors import CompressflowError
from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from compressflow.recipes.render import render
from compressflow.registries.architectures import ARCHITECTURES
from compressflow.store.manifest import read_manifest
from compressflow.tasks.adapt_recipe import adapt_recipe
from compressflow.tasks.fetch_model import fetch

PRESETS = ["W4A16", "W8A8", "FP8_DYNAMIC"]
ARCHITECTURE_NAMES = [*ZOO, *VISION_BUILDERS]

# Cells that refuse by design, with words their error must hold; every other cell publishes.
REFUSALS: dict[tuple[str, str], list[str]] = {
    # Text samples never reach Mllama's cross-attention layers (they read image states), so
    # those layers would get no calibration statistics: refused on the meta model, in seconds.
    ("mllama", "W4A16"): ["recipe.sequential_targets", "does not reach every layer"],
    ("mllama", "W8A8"): ["recipe.sequential_targets", "does not reach every layer"],
}


@pytest.fixture(scope="session")
def zoo_root(test_root) -> Path:
    return test_root / "zoo"


@pytest.mark.matrix
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ARCHITECTURE_NAMES)
def test_preset_publishes_a_verified_model_or_refuses_clearly(
    prefect_harness, zoo_root, tmp_path, name, preset, with_vllm
):
    source = build_tiny(name, zoo_root)
    target = tmp_path / "out"
    params = dict(
        model=ModelArgs(model_id=str(source), model_class=model_class(name)),
        dataset=DatasetArgs(text_samples=16, max_seq_len=128),
        recipe=RecipeArgs(recipe=preset),
        output=OutputArgs(save_directory=str(target)),
    )
    if (name, preset) in REFUSALS:
        with pytest.raises(CompressflowError) as raised:
            compress(**params)
        assert "Fix:" in str(raised.value)
        for word in REFUSALS[name, preset]:
            assert word in str(raised.value)
        assert not target.exists()
        return
    import os

    try:
        published = compress(**params)
    except CompressflowError as exc:
        with open(os.environ["MATRIX_RECORD"], "a") as rec:
            rec.write(json.dumps({"name": name, "preset": preset, "error": str(exc)}) + "\n")
        raise
    manifest = read_manifest(Path(published.path))
    with open(os.environ["MATRIX_RECORD"], "a") as rec:
        rec.write(
            json.dumps(
                {
                    "name": name,
                    "preset": preset,
                    "passed": manifest.verification.passed,
                    "checks": [c.model_dump() for c in manifest.verification.checks],
                    "vllm": manifest.verification.vllm.model_dump()
                    if manifest.verification.vllm
                    else None,
                }
            )
            + "\n"
        )
    assert manifest.verification.passed, manifest.verification
    # What a server needs beside the weights, even where the processor could not be built here.
    for file in source.glob("*processor_config.json"):
        assert (Path(published.path) / file.name).exists(), file.name
    assert_published_model_matches_base(Path(published.path), source, model_class(name))


def image_captions(args) -> Dataset:
    """Image+caption rows for vision calibration: random images, standard-library captions."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)) for _ in range(8)]
    return Dataset.from_dict({"image": images, "caption": [d[:200] for d in python_docs()[:8]]})


# Vision calibration where the model allows it; Qwen2.5-VL's processor needs torchvision.
VISION_REFUSALS = {"qwen2_5_vl": ["dataset.vision_samples", "requires the Torchvision library"]}


@pytest.mark.matrix
@pytest.mark.parametrize("preset", ["W4A16", "W8A8"])
@pytest.mark.parametrize("name", list(VISION_BUILDERS))
def test_vision_calibration_publishes_a_verified_model_or_refuses_clearly(
    prefect_harness, zoo_root, tmp_path, name, preset
):
    source = build_tiny(name, zoo_root)
    target = tmp_path / "out"
    params = dict(
        model=ModelArgs(model_id=str(source)),  # the default class: resolved from config.json
        dataset=DatasetArgs(
            dataset_loader="test_architectures:image_captions",
            vision_samples=4,
            text_samples=0,
            max_seq_len=512,
        ),
        recipe=RecipeArgs(recipe=preset),
        output=OutputArgs(save_directory=str(target)),
    )
    if name in VISION_REFUSALS:
        with pytest.raises(CompressflowError) as raised:
            compress(**params)
        for word in ["Fix:", *VISION_REFUSALS[name]]:
            assert word in str(raised.value)
        assert not target.exists()
        return
    published = compress(**params)
    assert read_manifest(Path(published.path)).verification.passed
    assert_published_model_matches_base(Path(published.path), source, model_class(name))


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
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


def model_type(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["model_type"]
