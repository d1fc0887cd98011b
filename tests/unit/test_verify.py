"""The verify stage's checks, each shown to fail on the defect it exists for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.models import CountedOpen, model_free_output

from compressflow.demo.zoo import VISION_BUILDERS, ZOO, build_tiny, model_class
from compressflow.results import RenderedRecipe
from compressflow.verification.config import check_quantization_config
from compressflow.verification.names import check_names

RECIPE = RenderedRecipe(
    yaml="",
    sha256="",
    source="preset:W4A16",
    modifiers=["GPTQModifier"],
    scheme="W4A16",
    pipeline="sequential",
    needs_data=True,
)


def write_config(folder: Path, quantization: dict | None) -> None:
    config = {"model_type": "llama"}
    if quantization is not None:
        config["quantization_config"] = quantization
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


def group(fmt: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": {}}}


@pytest.mark.parametrize(
    "quantization, passed, words",
    [
        (group("pack-quantized"), True, ["pack-quantized"]),
        (group("dense"), False, ["dense", "unpacked"]),
        (None, False, ["none in config.json", "W4A16"]),
    ],
)
def test_quantization_config_must_be_present_and_packed(tmp_path, quantization, passed, words):
    write_config(tmp_path, quantization)
    check = check_quantization_config(tmp_path, RECIPE)
    assert check.passed is passed
    for word in words:
        assert word in check.detail


def test_tensor_names_must_map_onto_the_source(tiny_model, tmp_path):
    source = Path(tiny_model)
    good = tmp_path / "good"
    shutil.copytree(source, good)
    tensors = load_file(good / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(1)  # quantization adds these
    save_file(tensors, good / "model.safetensors")
    assert check_names(good, source).passed

    # What Mixtral did: experts saved under names the source does not have, its own missing.
    renamed = tmp_path / "renamed"
    shutil.copytree(source, renamed)
    tensors = load_file(renamed / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.gate_proj.weight"] = tensors.pop(
        "model.layers.0.mlp.gate_proj.weight"
    )
    save_file(tensors, renamed / "model.safetensors")
    check = check_names(renamed, source)
    assert not check.passed
    assert "experts.0.gate_proj.weight" in check.detail
    assert "model.layers.0.mlp.gate_proj.weight" in check.detail


@pytest.mark.parametrize(
    "name", ["model.norm.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
)
def test_a_tensor_saved_under_a_source_name_keeps_the_source_shape(tiny_model, tmp_path, name):
    """A wrong-shaped norm or weight reloads with no mismatched keys from a compressed-tensors
    checkpoint, and the model-free one pass reads the source's copy: only the headers tell."""
    source = Path(tiny_model)
    output = tmp_path / "output"
    shutil.copytree(source, output)
    tensors = load_file(output / "model.safetensors")
    tensors[name] = tensors[name][:-1].clone()  # one row short
    save_file(tensors, output / "model.safetensors")
    check = check_names(output, source)
    assert not check.passed
    rows, *rest = load_file(source / "model.safetensors")[name].shape
    assert f"{name} {[rows - 1, *rest]} saved, {[rows, *rest]} in the source" in check.detail


def test_quantization_parameters_may_change_shape(tiny_model, tmp_path):
    """Scales of a source quantized already are the output's own (per tensor -> per channel)."""
    source, output = tmp_path / "source", tmp_path / "output"
    shutil.copytree(tiny_model, source)
    shutil.copytree(tiny_model, output)
    for folder, shape in ((source, (1,)), (output, (64, 1))):
        tensors = load_file(folder / "model.safetensors")
        tensors["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(shape)
        save_file(tensors, folder / "model.safetensors")
    assert check_names(output, source).passed


@pytest.mark.parametrize(
    ("shape", "scale_shape"),
    [
        ((384, 128), (3, 1)),  # 128 x 128 blocks, one block column: not a per-row scale
        ((128, 384), (1, 3)),
        ((300, 200), (3, 2)),  # partial blocks at the edges
        ((384, 128), (384, 1)),  # per row
        ((384, 128), (1, 1)),  # per tensor
    ],
)
def test_an_fp8_weight_dequantizes_with_its_scale_per_tensor_row_or_block(
    tmp_path, shape, scale_shape
):
    """The model-free check reads FP8_BLOCK weights of a model 128 wide (found on the yardstick:
    a [3, 1] block scale was taken for a per-row one and the check crashed)."""
    from safetensors import safe_open

    from compressflow.verification.weights import dequantized

    scale = torch.rand(scale_shape) + 0.5
    rows, cols = -(-shape[0] // scale_shape[0]), -(-shape[1] // scale_shape[1])
    full = scale.repeat_interleave(rows, 0)[: shape[0]].repeat_interleave(cols, 1)[:, : shape[1]]
    weight = torch.randn(shape).to(torch.float8_e4m3fn)
    save_file({"m.weight": weight, "m.weight_scale": scale}, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        got = dequantized(handle.get_tensor, "m", set(handle.keys()))
    assert torch.equal(got, weight.float() * full)


@pytest.mark.parametrize("name", [*ZOO, *VISION_BUILDERS])
def test_held_out_texts_go_through_together_with_the_logits_of_one_forward_each(test_root, name):
    """Verify and the reference capture run every held-out text in one forward (an offloaded
    model then reads each weight from disk once, not once per text): padding must not move a
    real token's logits, on any architecture the zoo builds, vision-language ones included."""
    import transformers

    from compressflow.evaluation.quality import logits_of

    path = build_tiny(name, test_root / "zoo")  # shared with tests/matrix/test_architectures.py
    model = getattr(transformers, model_class(name)).from_pretrained(path, dtype=torch.float32)
    vocab = model.config.get_text_config().vocab_size
    samples = [[(5 + i) % vocab for i in range(n)] for n in (7, 31, 1, 16)]  # padded rows
    calls = []
    model.eval().register_forward_hook(lambda *_: calls.append(1))
    batched = logits_of(model, samples)
    assert len(calls) == 1
    with torch.inference_mode():
        alone = [model(torch.tensor([ids])).logits[0] for ids in samples]
    for got, want, ids in zip(batched, alone, samples, strict=True):
        assert got.shape == (len(ids), want.shape[-1])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # Its own storage: the saved reference holds these texts, not the padded batch.
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()


def test_long_held_out_texts_split_into_forwards_under_the_token_budget():
    from compressflow.evaluation.quality import forwards

    samples = [[1] * n for n in (7, 31, 1, 16)]
    assert forwards(samples, 62) == [samples[:2], samples[2:]]  # 2 x 31, then 2 x 16
    assert forwards(samples, 8) == [[s] for s in samples]  # each alone, the 31 over budget too
    assert forwards(samples, 4096) == [samples]


def test_a_reloaded_model_on_disk_reads_each_tensor_once_per_forward(tiny_model, tmp_path):
    """compressed-tensors' quantized forward read each quantized weight from disk twice per
    forward (compat.onload_weights_once): the logits check of a model-free run read the
    decompressed model twice per pass."""
    from collections import Counter

    from compressed_tensors.offload.cache.disk import DiskCache

    from compressflow.evaluation.quality import logits_of
    from compressflow.verification.reload import reload

    out, model, plan = model_free_output(tiny_model, tmp_path)
    loaded, _ = reload(out, model, plan)
    logits_of(loaded, [[5, 6, 7]])  # the first forward decompresses the FP8 weights to disk
    reads: Counter = Counter()
    onload = DiskCache.onload

    def counted(self, offloaded):
        if offloaded is not None:
            reads[self.index[offloaded]["safetensors_file"], tuple(offloaded.shape)] += 1
        return onload(self, offloaded)

    DiskCache.onload = counted
    try:
        logits_of(loaded, [[5, 6, 7]])
    finally:
        DiskCache.onload = onload
    assert len(reads) > 14 and max(reads.values()) == 1  # 14 quantized Linears, and the rest


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8_BLOCK"])
def test_a_model_free_output_is_checked_in_one_pass_as_the_reloaded_model_computes(
    tiny_model, tmp_path, scheme, counted_reads
):
    """The weights and logits checks of a model-free run share one forward of the source
    streamed from its checkpoint: each source tensor and each output tensor is read once, nothing
    is loaded before it, and the logits and weight errors are those the reloaded checkpoint
    gives."""
    from transformers import AutoModelForCausalLM

    from compressflow.evaluation.quality import compare_logits, logits_of
    from compressflow.verification.logits import one_pass_logits
    from compressflow.verification.reload import reload
    from compressflow.verification.weights import check_weights

    out, model, plan = model_free_output(tiny_model, tmp_path, scheme)
    samples = [[5, 6, 7, 8, 9], [10, 11, 12]]
    loaded, _ = reload(out, model, plan)
    reloaded = logits_of(loaded, samples)
    del loaded

    source_model = AutoModelForCausalLM.from_pretrained(tiny_model)
    source_logits = logits_of(source_model, samples)
    del source_model

    counted_reads.clear()
    base, logits, errors = one_pass_logits(out, model, plan, samples)
    assert len(errors) == 14  # 7 Linears in each of the 2 layers
    source = {name for file, name in counted_reads if file.parent == tiny_model.resolve()}
    output = {name for file, name in counted_reads if file.parent == out.resolve()}
    assert max(counted_reads.values()) == 1
    assert source == set(load_file(next(tiny_model.glob("*.safetensors"))))
    assert len(output) == 28 and all(n.endswith((".weight", ".weight_scale")) for n in output)
    figures = compare_logits(reloaded, logits)
    assert figures["cosine"] > 0.9999 and figures["top1_agreement"] == 1.0
    # The first copy of each sample went through the source's own weights: the reference.
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(source_logits, base, strict=True))
    assert compare_logits(source_logits, logits)["kl_divergence"] > 1e-6  # the second did not
    # The same errors check_weights finds reading both checkpoints itself.
    assert check_weights(out, tiny_model).detail == check_weights(out, tiny_model, errors).detail


class HeadersOnly(CountedOpen):
    """safetensors.safe_open for transformers' loader that hands out shapes and dtypes only: a
    read of any tensor's data fails the test."""

    def get_slice(self, name):
        whole = self.handle.get_slice(name)
        return SimpleNamespace(get_shape=whole.get_shape, get_dtype=whole.get_dtype)

    def get_tensor(self, name):
        pytest.fail(f"read {name}")


def test_a_model_free_reload_checks_the_keys_reading_no_weight(tiny_model, tmp_path, monkeypatch):
    """After the one pass has read the output's weights, its reload builds the model on the meta
    device from the safetensors headers: no weight is read a second time, and a tensor the
    output lacks is still reported as transformers reports it."""
    import transformers.modeling_utils

    from compressflow.model.headers import tensor_index
    from compressflow.verification.reload import reload

    out, model, plan = model_free_output(tiny_model, tmp_path)
    monkeypatch.setattr(transformers.modeling_utils, "safe_open", HeadersOnly)
    loaded, check = reload(out, model, plan, weights=False)
    assert check.passed, check.detail
    assert {parameter.device.type for parameter in loaded.parameters()} == {"meta"}

    lost = "model.layers.1.mlp.up_proj.weight_scale"
    shard = tensor_index(out)[lost].file
    tensors = load_file(shard)
    del tensors[lost]
    save_file(tensors, shard, metadata={"format": "pt"})
    if (index := out / "model.safetensors.index.json").exists():
        data = json.loads(index.read_text())
        del data["weight_map"][lost]
        index.write_text(json.dumps(data))
    _, check = reload(out, model, plan, weights=False)
    assert not check.passed and "missing keys" in check.detail and lost in check.detail


def test_a_model_free_verification_reads_the_source_once_and_the_output_once(
    tiny_model, tmp_path, monkeypatch, counted_reads
):
    """The whole verification of a model-free run (the reference, every check but vLLM's, which
    a server's own load reads): each source tensor is read once, no output tensor twice, and
    the reload reads headers only (transformers' loader fails the test on a read of data)."""
    import transformers.modeling_utils

    from compressflow.params import VerifyArgs
    from compressflow.results import Calibration
    from compressflow.verification.registry import CHECKS
    from compressflow.verification.run import run_checks

    out, model, plan = model_free_output(tiny_model, tmp_path)
    model = model.model_copy(update={"model_id": "tiny"})
    recipe = RECIPE.model_copy(update={"scheme": "FP8_DYNAMIC", "source": "preset:FP8_DYNAMIC"})
    calibration = Calibration(staging_path=str(out), seconds=1, peak_rss_mb=1, checkpoint_bytes=1)
    monkeypatch.setattr(transformers.modeling_utils, "safe_open", HeadersOnly)
    counted_reads.clear()
    result = run_checks(calibration, model, recipe, plan, VerifyArgs(vllm="off"))
    assert result.passed and [c.name for c in result.checks] == list(CHECKS), result.checks
    source = {name for file, name in counted_reads if file.parent == tiny_model.resolve()}
    output = {name for file, name in counted_reads if file.parent == out.resolve()}
    assert max(counted_reads.values()) == 1  # one read of each tensor, whichever checkpoint
    assert source == set(load_file(next(tiny_model.glob("*.safetensors"))))
    assert output and output <= set(load_file(next(out.glob("*.safetensors"))))


def test_a_linear_fed_its_rows_out_of_order_turns_the_one_pass_down(
    tiny_model, tmp_path, monkeypatch
):
    """The one pass tells the base's copy of each text from the compressed model's by batch row:
    a model that feeds a Linear [tokens, rows, ...] would mix them into plausible numbers, so
    the pass gives up (None: separate passes follow) instead, without loading the model."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from compressflow.verification import logits

    out, model, plan = model_free_output(tiny_model, tmp_path)
    mlp = LlamaMLP.forward
    monkeypatch.setattr(LlamaMLP, "forward", lambda self, x: mlp(self, x.transpose(0, 1)))
    monkeypatch.setattr(logits, "load_offloaded", lambda *_: pytest.fail("loaded the source"))
    assert logits.one_pass_logits(out, model, plan, [[5, 6, 7, 8, 9], [10, 11, 12]]) is None


def test_a_model_free_output_whose_source_cannot_stream_is_checked_on_it_loaded_from_disk(
    tiny_model, tmp_path, monkeypatch
):
    """A source that cannot stream (a checkpoint transformers renames on load, fused experts):
    the one pass runs on the source loaded with its weights on disk, with the same result."""
    from compressflow.evaluation.quality import compare_logits
    from compressflow.verification import logits

    out, model, plan = model_free_output(tiny_model, tmp_path)
    samples = [[5, 6, 7, 8, 9], [10, 11, 12]]
    streamed = logits.one_pass_logits(out, model, plan, samples)
    monkeypatch.setattr(logits, "streamed_model", lambda *_: None)
    loaded = logits.one_pass_logits(out, model, plan, samples)
    assert loaded.errors == pytest.approx(streamed.errors) and len(loaded.errors) == 14
    for kind in ("base", "logits"):
        figures = compare_logits(getattr(streamed, kind), getattr(loaded, kind))
        assert figures["cosine"] > 0.9999 and figures["top1_agreement"] == 1.0


# --- the registry: each check carries its name, the field a failure blames, and the fix --------


def test_every_check_is_registered_once_and_records_itself_under_its_name(tmp_path):
    """Each module of compressflow/verification/ that defines a check is in the registry, under
    its own name, with a field and a fix; each check's function records what it finds under that
    name, so every check a Verification can hold has an entry the task's error reads."""
    import importlib
    import pkgutil

    from compressflow import verification
    from compressflow.params import VerifyArgs
    from compressflow.results import FetchedModel, MemoryPlan, VerificationCheck
    from compressflow.verification.registry import CHECKS

    modules = [
        importlib.import_module(f"{verification.__name__}.{info.name}")
        for info in pkgutil.iter_modules(verification.__path__)
    ]
    defined = [module.CHECK for module in modules if hasattr(module, "CHECK")]
    assert len({check.name for check in defined}) == len(defined) == len(CHECKS)
    assert set(defined) == set(CHECKS.values())
    for name, check in CHECKS.items():
        assert name == check.name and check.field.strip() and check.fix.strip(), check

    # Each function, run on a state where it returns at once, records its check under the
    # registry's name; a check that does not apply to the run records nothing.
    from compressflow.verification import Verifying
    from compressflow.verification.logits import OnePass

    write_config(tmp_path, None)
    model = FetchedModel(
        path=str(tmp_path), source="local", model_id="m", identity="sha256:test", size_bytes=0
    )
    reference = {"logits": [torch.randn(2, 8)], "input_ids": [[1, 2]]}

    def state(path: str = "classic", **handed_on) -> Verifying:
        plan = MemoryPlan.model_construct(path=path, placement="cpu")
        return Verifying(tmp_path, model, RECIPE, plan, VerifyArgs(vllm="off"), **handed_on)

    model_free = {"reference": reference, "one_pass": OnePass([], [torch.randn(2, 8)], {})}
    applies = {
        "quantization config": state(),
        "tokenizer fits": state(),
        "tensor names": state(),
        "weights": state("model_free", **model_free),
        "reload": state(),
        "logits": state("model_free", **model_free),
        "vllm": state(reference=reference),
    }
    assert applies.keys() == CHECKS.keys()
    for name, check in CHECKS.items():
        assert check.function(applies[name]).name == name
    # Where a check does not apply, it records nothing.
    failed = VerificationCheck(name="reload", passed=False, detail="missing keys")
    assert CHECKS["weights"].function(state()) is None  # model-free runs only
    assert CHECKS["logits"].function(state(reference=reference)) is None  # nothing reloaded
    assert CHECKS["vllm"].function(state(reference=reference, checks=[failed])) is None


@pytest.mark.parametrize("recipe_source", ["preset:W4A16", "file:recipe.yaml"])
def test_a_failed_check_raises_with_the_field_and_fix_of_its_registry_entry(
    tmp_path, monkeypatch, recipe_source
):
    """The first failed check's entry says what VerificationError names: its field ("recipe"
    standing for the parameter the recipe was given in) and its fix."""
    from compressflow.errors import VerificationError
    from compressflow.params import VerifyArgs
    from compressflow.results import (
        Calibration,
        FetchedModel,
        MemoryPlan,
        Verification,
        VerificationCheck,
    )
    from compressflow.tasks import verify
    from compressflow.verification.registry import CHECKS

    recipe = RECIPE.model_copy(update={"source": recipe_source})
    given_in = "recipe.preset" if recipe_source.startswith("preset:") else "recipe.recipe"
    model = FetchedModel(
        path=str(tmp_path), source="local", model_id="m", identity="sha256:test", size_bytes=0
    )
    calibration = Calibration(
        staging_path=str(tmp_path), seconds=1, peak_rss_mb=1, checkpoint_bytes=1
    )
    monkeypatch.setattr(verify, "create_markdown_artifact", lambda *args, **kwargs: None)
    for name, check in CHECKS.items():
        checks = [
            VerificationCheck(name=other, passed=True, detail="fine")
            for other in CHECKS
            if other != name
        ]
        failed = Verification(
            passed=False,
            checks=[*checks, VerificationCheck(name=name, passed=False, detail="wrong")],
        )
        monkeypatch.setattr(verify, "in_child", lambda function, *args, result=failed: result)
        with pytest.raises(VerificationError) as raised:
            verify.verify.fn(
                calibration,
                model,
                recipe,
                MemoryPlan.model_construct(path="classic", placement="cpu"),
                VerifyArgs(),
                "out",
            )
        assert raised.value.field == (given_in if check.field == "recipe" else check.field)
        assert raised.value.fix == check.fix
        assert f"{name}: wrong" in raised.value.problem


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8_BLOCK", "MXFP8"])
def test_model_free_writes_the_same_bytes_without_the_linears_random_init(
    sharded_tiny_model, tmp_path, scheme
):
    """The calibrate stage runs model_free_ptq with torch's init functions turned off (each
    quantized weight's Linear is built, then the checkpoint's weight copied over it): every
    file it writes is what the library alone writes, for each scheme the model-free plan runs."""
    from compressflow.calibration.run import calibrate_model_free
    from compressflow.results import FetchedModel

    plain, _, plan = model_free_output(sharded_tiny_model, tmp_path, scheme)
    plan = plan.model_copy(
        update={"model_free_ignore": ["lm_head", "re:.*embed_tokens"], "device": "cpu"}
    )
    model = FetchedModel.model_construct(
        path=str(sharded_tiny_model), model_id="tiny", model_class="LlamaForCausalLM"
    )
    fast = tmp_path / "fast"
    calibrate_model_free(model, plan, str(fast))
    written = sorted(path.name for path in plain.glob("*.safetensors"))
    assert written and written == sorted(path.name for path in fast.glob("*.safetensors"))
    assert all((plain / name).read_bytes() == (fast / name).read_bytes() for name in written)
    assert torch.nn.Linear(4, 4).weight.abs().sum() > 0  # torch's init is back afterwards
