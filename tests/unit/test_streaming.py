"""A streamed model (compressflow/model/streaming.py): the logits a loaded model gives, with each
checkpoint tensor read once and no load before the forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compressflow.demo.zoo import VISION_BUILDERS, ZOO, build_tiny, model_class
from compressflow.evaluation.quality import logits_of, logits_streamed
from compressflow.model.streaming import streamed_model
from compressflow.results import FetchedModel


def fetched(path: Path, name: str) -> FetchedModel:
    return FetchedModel.model_construct(
        path=str(path), model_class=model_class(name), trust_remote_code=False
    )


@pytest.mark.parametrize("name", [*ZOO, *VISION_BUILDERS])
def test_a_streamed_model_gives_the_loaded_models_logits_reading_each_tensor_once(
    test_root, name, counted_reads
):
    """Every architecture the zoo builds either streams, reading each tensor at most once in a
    forward and giving the loaded model's logits, or says it cannot (None) and is loaded."""
    import transformers

    path = build_tiny(name, test_root / "zoo")  # shared with tests/matrix/test_architectures.py
    loaded = getattr(transformers, model_class(name)).from_pretrained(path).eval()
    vocab = loaded.config.get_text_config().vocab_size
    samples = [[(5 + i) % vocab for i in range(n)] for n in (7, 3)]
    want = logits_of(loaded, samples)
    counted_reads.clear()
    streamed = streamed_model(fetched(path, name), path)
    assert not counted_reads  # nothing read before the forward
    got = logits_streamed(streamed, samples)
    if name in CANNOT_STREAM:
        assert got is None
        return
    assert got is not None, f"{name} no longer streams: add it to CANNOT_STREAM with the reason"
    assert counted_reads and max(counted_reads.values()) == 1
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


# Measured on the zoo; each is loaded with its weights on disk instead (read once more).
CANNOT_STREAM = {
    "gpt_neox": "its checkpoint names the head embed_out; transformers renames it on load",
    **dict.fromkeys(
        ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"],
        "transformers fuses the checkpoint's per-expert Linears into one tensor on load",
    ),
    **dict.fromkeys(
        ["llava", "qwen2_5_vl", "mllama", "gemma3"],
        "transformers renames the checkpoint's language and vision modules on load",
    ),
}


def edited_copy(tiny_model: Path, folder: Path, edit) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, folder)
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    "edit",
    [
        # several float dtypes: transformers casts them to one while loading
        lambda t: t.update({"model.norm.weight": t["model.norm.weight"].half()}),
        # not a float: a quantized tensor under a float parameter's name
        lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int8)}),
    ],
    ids=["mixed-dtypes", "not-a-float"],
)
def test_a_checkpoint_transformers_converts_on_load_does_not_stream(tiny_model, tmp_path, edit):
    """Streaming reads tensors as the checkpoint holds them: one that transformers would
    convert while loading gives None, and the caller loads the model with transformers (the
    renames and fused experts it converts: CANNOT_STREAM)."""
    folder = edited_copy(tiny_model, tmp_path / "edited", edit)
    assert streamed_model(fetched(folder, "llama"), folder) is None


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.update({"renamed.norm.weight": t.pop("model.norm.weight")}),
        lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]}),
    ],
    ids=["renamed", "reshaped"],
)
def test_a_checkpoint_transformers_would_load_incompletely_is_refused(tiny_model, tmp_path, edit):
    """A tensor the model needs that the files lack, under its name and shape, and that no
    conversion of transformers' supplies: refused as loading it would be (the complete-load
    contract, tests/unit/test_complete_load.py), not streamed around nor left to the load."""
    from compressflow.errors import InputError

    folder = edited_copy(tiny_model, tmp_path / "edited", edit)
    with pytest.raises(InputError, match="model.norm.weight"):
        streamed_model(fetched(folder, "llama"), folder)


def test_a_quantized_checkpoint_does_not_stream(tiny_model, tmp_path):
    """A quantization_config means transformers' quantizer builds other modules on load."""
    import json

    folder = edited_copy(tiny_model, tmp_path / "quantized", lambda t: None)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    assert streamed_model(fetched(folder, "llama"), folder) is None


def test_a_failed_streamed_forward_falls_back_with_a_warning_that_says_why(caplog):
    """Streaming only saves reads: a forward that fails (a weight still on the meta device, or
    anything else) returns None, and the caller loads the model instead."""

    class Fails(torch.nn.Module):
        def __init__(self, error):
            super().__init__()
            self.error = error
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, **_):
            raise self.error

    meta = NotImplementedError("Cannot copy out of meta tensor; no data!")
    assert logits_streamed(Fails(meta), [[1]]) is None
    assert "NotImplementedError: Cannot copy out of meta tensor" in caplog.text
    assert logits_streamed(Fails(RuntimeError("expected the same dtype")), [[1]]) is None
    assert "loading it instead" in caplog.text and "expected the same dtype" in caplog.text
    assert logits_streamed(None, [[1]]) is None


def test_a_model_that_cannot_be_built_does_not_stream(tiny_model, caplog):
    """Building on the meta device can fail where loading would not (remote code, a config read
    only while loading): None and a warning, and the caller loads the model."""
    model = FetchedModel.model_construct(
        path=str(tiny_model), model_id="m", model_class="NoSuchClass", trust_remote_code=False
    )
    assert streamed_model(model, tiny_model) is None
    assert "Cannot stream m's weights (AttributeError" in caplog.text
