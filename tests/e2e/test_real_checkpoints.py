"""Model folders as they really come: broken configs, no tokenizer, NaN weights, and the extra
tensors older checkpoints carry (per-layer `rotary_emb.inv_freq`, a tied `lm_head` saved twice).

Each is refused before calibration with the field and the fix, or, when transformers loads it
fine, compressed and published.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.models import model_free_output

from compressflow.calibration.run import capture_reference, load_for_calibration
from compressflow.errors import ModelFetchError
from compressflow.evaluation.quality import logits_of
from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, VerifyArgs
from compressflow.results import MemoryPlan
from compressflow.tasks.fetch_model import fetch
from compressflow.verification.names import check_names

pytestmark = pytest.mark.usefixtures("prefect_harness")

NAN_TENSOR = "model.layers.1.mlp.down_proj.weight"


def copy_of(tiny_model: Path, folder: Path) -> Path:
    shutil.copytree(tiny_model, folder)
    return folder


def edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture()
def old_llama(tiny_model, tmp_path) -> Path:
    """The tiny Llama as older hub checkpoints are saved: tied embeddings written twice and
    per-layer rotary `inv_freq` buffers, which current transformers does not load."""
    folder = copy_of(tiny_model, tmp_path / "old-llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))

    def add_old_tensors(tensors):
        for layer in range(config["num_hidden_layers"]):
            tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    edit_weights(folder, add_old_tensors)
    return folder


# ---------------------------------------------------------------- config.json and tokenizer


def test_config_json_that_does_not_parse_names_the_file_line_and_column(tiny_model, tmp_path):
    folder = copy_of(tiny_model, tmp_path / "model")
    (folder / "config.json").write_text('{\n  "model_type": "llama",\n}\n')
    with pytest.raises(ModelFetchError) as error:
        fetch(ModelArgs(model_id=str(folder)))
    message = str(error.value)
    assert message.startswith("model.model_id: ")
    assert f"{folder / 'config.json'} is not valid JSON" in message
    assert "line 3, column 1" in message and "Fix: fix config.json" in message


@pytest.mark.parametrize("content", ["[]", '"llama"', "null"])
def test_config_json_that_is_not_an_object_is_refused(tiny_model, tmp_path, content):
    folder = copy_of(tiny_model, tmp_path / "model")
    (folder / "config.json").write_text(content)
    with pytest.raises(ModelFetchError, match=r"model\.model_id: .*not an object.*Fix: replace"):
        fetch(ModelArgs(model_id=str(folder)))


def test_config_json_that_is_a_folder_is_no_config(tiny_model, tmp_path):
    folder = copy_of(tiny_model, tmp_path / "model")
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    with pytest.raises(ModelFetchError, match="config.json is a folder, not a regular file"):
        fetch(ModelArgs(model_id=str(folder)))


def test_folder_without_a_tokenizer_is_refused_before_weights_load(tiny_model, tmp_path):
    folder = copy_of(tiny_model, tmp_path / "model")
    for file in [*folder.glob("tokenizer*"), folder / "chat_template.jinja"]:
        file.unlink()
    with pytest.raises(ModelFetchError) as error:
        fetch(ModelArgs(model_id=str(folder)))
    message = str(error.value)
    assert message.startswith("model.model_id: ") and "holds no tokenizer" in message
    assert "Fix: add the tokenizer files" in message


# ---------------------------------------------------------------- non-finite source weights


@pytest.fixture()
def nan_model(tiny_model, tmp_path):
    folder = copy_of(tiny_model, tmp_path / "nan-model")

    def poison(tensors):
        tensors[NAN_TENSOR][0, 0] = float("nan")

    edit_weights(folder, poison)
    return fetch(ModelArgs(model_id=str(folder)))


def test_nan_in_the_source_is_refused_when_calibration_loads_it(nan_model):
    plan = MemoryPlan.model_construct(path="classic", placement="cpu")
    with pytest.raises(ModelFetchError) as error:
        load_for_calibration(nan_model, plan)
    message = str(error.value)
    assert message.startswith("model.model_id: the SOURCE model")
    assert f"non-finite values (NaN or inf) in tensor {NAN_TENSOR}" in message
    assert "Fix: use another checkpoint or revision" in message


def test_nan_in_weights_read_from_disk_is_refused_at_the_reference_logits(nan_model, tmp_path):
    """Offloaded and model-free runs never hold every weight: the first forward pass finds it,
    and the checkpoint names the tensor."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(nan_model.path)
    tokenizer = AutoTokenizer.from_pretrained(nan_model.path)
    with pytest.raises(ModelFetchError, match=f"SOURCE model .* in tensor {NAN_TENSOR}"):
        capture_reference(
            partial(logits_of, model), tokenizer, VerifyArgs(), tmp_path / "staging", nan_model
        )


def test_nan_in_a_model_free_source_is_refused_by_verify_naming_the_tensor(nan_model, tmp_path):
    """The model-free path leaves the source as it is, so its reference logits come from verify's
    one pass: a source with NaN is refused there as the source's fault, not the compression's."""
    from compressflow.results import Calibration, RenderedRecipe
    from compressflow.verification.run import run_checks

    out, _, plan = model_free_output(Path(nan_model.path), tmp_path)
    calibration = Calibration(staging_path=str(out), seconds=1, peak_rss_mb=1, checkpoint_bytes=1)
    recipe = RenderedRecipe.model_construct(
        scheme="FP8_DYNAMIC", modifiers=["QuantizationModifier"]
    )
    with pytest.raises(ModelFetchError) as error:
        run_checks(calibration, nan_model, recipe, plan, VerifyArgs(vllm="off"))
    message = str(error.value)
    assert f"non-finite values (NaN or inf) in tensor {NAN_TENSOR}" in message
    assert "found while verifying its compressed copy" in message


# ---------------------------------------------------------------- tensors transformers drops


def test_source_tensors_transformers_does_not_load_are_not_held_against_the_output(
    old_llama, tmp_path
):
    from transformers import AutoModelForCausalLM

    output = tmp_path / "output"
    AutoModelForCausalLM.from_pretrained(old_llama).save_pretrained(output)
    saved = load_file(output / "model.safetensors")
    assert "lm_head.weight" not in saved and not any("inv_freq" in name for name in saved)

    check = check_names(output, old_llama)
    assert check.passed, check.detail
    assert "3 source tensor(s) transformers does not load" in check.detail

    # A weight the model does load is still missed when it goes missing.
    edit_weights(output, lambda tensors: tensors.pop("model.layers.0.mlp.up_proj.weight"))
    check = check_names(output, old_llama)
    assert not check.passed and "model.layers.0.mlp.up_proj.weight" in check.detail


def test_an_old_llama_checkpoint_is_compressed_and_published(old_llama, tmp_path):
    published = compress(
        model=ModelArgs(model_id=str(old_llama)),
        dataset=DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64),
        recipe=RecipeArgs(preset="W4A16"),
        output=OutputArgs(save_directory=str(tmp_path / "out")),
    )
    manifest = json.loads((Path(published.path) / "manifest.json").read_text())
    assert manifest["verification"]["passed"]
    assert "transformers does not load" in json.dumps(manifest["verification"])
