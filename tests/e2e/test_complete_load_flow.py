"""compress-model on a checkpoint that transformers would load with a tensor missing: refused
before calibration, on the classic path and the model-free one, with nothing written.

Before, the flow calibrated the half-random model, verified it against a base loaded the same
way, and published it (issue 39). The unit tests of the contract are tests/unit/test_complete_load.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from compressflow.errors import InputError
from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs

pytestmark = pytest.mark.usefixtures("prefect_harness")

LOST = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("preset", ["W4A16", "FP8_DYNAMIC"])  # classic, model-free
def test_a_source_missing_a_tensor_is_refused_before_calibration(
    sharded_tiny_model, tmp_path, preset
):
    source = tmp_path / "source"
    shutil.copytree(sharded_tiny_model, source)
    index = source / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = source / data["weight_map"].pop(LOST)  # the index agrees with the shard
    tensors = load_file(shard)
    del tensors[LOST]
    save_file(tensors, shard, metadata={"format": "pt"})
    index.write_text(json.dumps(data))
    target = tmp_path / "out"
    with pytest.raises(InputError) as raised:
        compress(
            model=ModelArgs(model_id=str(source)),
            dataset=DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64),
            recipe=RecipeArgs(recipe=preset),
            output=OutputArgs(save_directory=str(target)),
        )
    message = str(raised.value)
    assert message.startswith(f"model.model_id: the source model at {source} does not load")
    assert f"missing keys ['{LOST}']" in message and "Fix:" in message
    assert not target.exists()
    assert not list(Path(tmp_path).glob(".out*staging*"))
