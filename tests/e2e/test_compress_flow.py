"""The compress-model flow end to end: real Prefect, real oneshot, ClearML offline.

Each preset that runs on CPU is calibrated on the tiny model, reloaded with transformers
(compressed-tensors) and must give finite logits. Reruns must reuse cached stages and outputs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from support.recipes import SEED_GUIDE_W4A16
from support.stand_ins import no_hardware_check

from compressflow.errors import CalibrationError, InputError, PublishError, VerificationError
from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, VerifyArgs

pytestmark = pytest.mark.usefixtures("prefect_harness")


def small_data(**changes) -> DatasetArgs:
    return DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64, **changes)


def assert_reloads_with_finite_logits(path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads(Path(path, "config.json").read_text())
    assert "quantization_config" in config, "not saved in compressed-tensors format"
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer(["Return the sum of a and b."], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()


def stage(published, name):
    return next(s for s in published.stages if s.name == name)


def assert_published_whole(published, target: Path) -> None:
    assert Path(published.path) == target and not published.reused
    assert {"manifest.json", "recipe.yaml", "config.json"} <= {p.name for p in target.iterdir()}
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["result"]["run_key"] == published.run_key
    # What overwriting it may delete: every file published, and nothing else.
    assert manifest["files"] == sorted(
        p.relative_to(target).as_posix() for p in target.rglob("*") if not p.is_dir()
    )
    # What a later run checks before reusing it: every published file's bytes but the two
    # that later runs rewrite.
    assert manifest["file_sha256"] == {
        name: hashlib.sha256((target / name).read_bytes()).hexdigest()
        for name in manifest["files"]
        if name not in ("manifest.json", "README.md")
    }
    assert manifest["libraries"]["llmcompressor"] == "0.14.0.1"
    assert published.compression_ratio > 1.5
    assert_reloads_with_finite_logits(published.path)
    assert not list(target.parent.glob(".*staging*")), "staging folder left behind"


@pytest.mark.parametrize("preset", ["W8A8", "FP8_DYNAMIC"])
def test_each_cpu_preset_publishes_a_reloadable_checkpoint(tiny_model, tmp_path, preset):
    target = tmp_path / preset
    published = compress(
        model=ModelArgs(model_id=str(tiny_model)),
        dataset=small_data(),
        recipe=RecipeArgs(recipe=preset),
        output=OutputArgs(save_directory=str(target)),
    )
    assert_published_whole(published, target)


def test_w4a16_publishes_a_reloadable_checkpoint(w4a16_run):
    assert_published_whole(w4a16_run.published, Path(w4a16_run.params["output"].save_directory))


def materializations(client, flow_run_id, timeout: float = 30.0) -> list[dict]:
    """The asset materialization events the run emitted, as the server stored them."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        response = client.request(
            "POST",
            "/events/filter",
            json={
                "filter": {
                    "event": {"prefix": ["prefect.asset.materialization"]},
                    "related": {"id": [f"prefect.flow-run.{flow_run_id}"]},
                },
                "limit": 50,
            },
        )
        events = response.json()["events"]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def test_a_run_is_named_and_tagged_after_its_model_and_shows_lineage(tiny_model, w4a16_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    target = Path(w4a16_run.params["output"].save_directory)
    state = w4a16_run.state
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        assert run.name == f"{tiny_model.name} W4A16"
        assert {"nightly", "team-a", "W4A16"} <= set(run.tags)
        # Task runs carry none: Prefect would ask the server for a concurrency slot per tag of
        # each, 2 s after a long stage on SQLite (flows/compress.py).
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        assert {t.name.rsplit("-", 1)[0] for t in task_runs} >= {"calibrate", "verify", "publish"}
        assert all(not t.tags for t in task_runs)
        events = materializations(client, flow_run_id)
    [event] = [e for e in events if e["event"].endswith("succeeded")]
    assert event["resource"]["prefect.resource.id"] == f"file://{target.resolve()}"
    upstream = {
        r["prefect.resource.id"]
        for r in event["related"]
        if r.get("prefect.resource.role") == "asset"
    }
    assert f"file://{Path(tiny_model).resolve()}" in upstream, "base model -> checkpoint"
    assert any(
        "datasets" in key or "cache" in key
        for key in upstream - {f"file://{Path(tiny_model).resolve()}"}
    ), upstream


def test_second_run_reuses_cached_stages_and_the_published_output(
    tiny_model, tmp_path, monkeypatch
):
    params = dict(
        model=ModelArgs(model_id=str(tiny_model)),
        dataset=small_data(seed=7),
        recipe=RecipeArgs(recipe=SEED_GUIDE_W4A16, recipe_args={"observer": "mse", "damp": 0.1}),
        output=OutputArgs(save_directory=str(tmp_path / "out")),
    )
    first = compress(**params)
    manifest = json.loads(Path(first.path, "manifest.json").read_text())
    assert manifest["modules"], "per-module metrics were not captured"
    assert all(m["error"] is not None for m in manifest["modules"])
    assert not stage(first, "build dataset").cached
    assert_reloads_with_finite_logits(first.path)

    # A reused run needs nothing torch knows, so it waits for no child (and its imports).
    children = []
    monkeypatch.setattr("compressflow.flows.checks.in_child", lambda *a: children.append(a))
    second = compress(**params)
    assert children == []
    assert second.reused and second.path == first.path and second.run_key == first.run_key
    assert stage(second, "fetch model").cached and stage(second, "build dataset").cached
    assert stage(second, "render recipe").cached
    assert "calibrate" not in {s.name for s in second.stages}
    # The demo's summary still lists every stage: the skipped ones from the run that made it.
    from compressflow.demo.__main__ import stage_lines
    from compressflow.store.manifest import read_manifest

    first_lines = stage_lines(first.stages, [])
    second_lines = stage_lines(second.stages, read_manifest(Path(second.path)).stages)
    assert [line.split()[0] for line in first_lines] == [s.name.split()[0] for s in first.stages]
    assert len(first_lines) == 9 and len(second_lines) == 9
    assert sum("not run: reused output" in line for line in second_lines) == 9 - len(second.stages)

    # A new recipe argument recalibrates, but still reuses the fetched model and dataset.
    third = compress(
        **{
            **params,
            "recipe": RecipeArgs(
                recipe=SEED_GUIDE_W4A16, recipe_args={"observer": "mse", "damp": 0.05}
            ),
            "output": OutputArgs(save_directory=str(tmp_path / "out2")),
        }
    )
    assert not third.reused and third.run_key != first.run_key
    assert stage(third, "fetch model").cached and stage(third, "build dataset").cached


def test_an_output_whose_weights_changed_since_publishing_is_refused_not_reused(
    w4a16_run, tmp_path
):
    folder = tmp_path / "copy"
    shutil.copytree(w4a16_run.published.path, folder)
    output = w4a16_run.params["output"].model_copy(update={"save_directory": str(folder)})
    params = {**w4a16_run.params, "output": output}
    assert compress(**params).reused  # a copy is the same output: the same bytes
    # One weight byte, the header intact: a corrupted copy, a hand edit, a tool writing there.
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(data)
    with pytest.raises(PublishError, match=r"it changed since \(model.safetensors: other bytes\)"):
        compress(**params)
    assert weights.read_bytes() == data
    # With overwrite it is published anew: the fuzzer's long run does that through the whole
    # flow (tests/matrix/test_fuzz_long.py), and checks the new folder against its manifest.


def test_a_source_written_while_the_run_reads_it_is_not_published(tiny_model, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(tiny_model, source)
    calibrating = threading.Event()

    def new_checkpoint_copied_over() -> None:
        # A real writer, racing the run: once calibration has begun (its staging folder is
        # there), a newer generation_config.json lands in the source, as a copy of a newer
        # checkpoint over the old one would.
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.staging-*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        (source / "generation_config.json").write_text('{"do_sample": true}')
        calibrating.set()

    writer = threading.Thread(target=new_checkpoint_copied_over, daemon=True)
    writer.start()
    with pytest.raises(InputError) as raised:
        compress(
            model=ModelArgs(model_id=str(source)),
            dataset=small_data(),
            recipe=RecipeArgs(recipe="W8A8"),
            output=OutputArgs(save_directory=str(tmp_path / "out")),
        )
    writer.join()
    assert calibrating.is_set()
    message = str(raised.value)
    assert message.startswith(f"model.model_id: {source} changed while this run read it")
    assert "(generation_config.json written, replaced or removed since it was fetched)" in message
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no output, no staging left


def test_output_holding_another_model_is_refused_before_calibration(tiny_model, tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "model.safetensors").write_text("somebody else's model")
    with pytest.raises(PublishError, match="overwrite: true"):
        compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=small_data(),
            recipe=RecipeArgs(recipe="FP8_DYNAMIC"),
            output=OutputArgs(save_directory=str(target)),
        )
    assert (target / "model.safetensors").read_text() == "somebody else's model"


def exploding_collator(batch):
    raise RuntimeError("collator bug found mid-calibration")


def test_failed_calibration_leaves_no_partial_output(tiny_model, tmp_path):
    target = tmp_path / "never"
    with pytest.raises(CalibrationError) as raised:
        compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=small_data(data_collator="test_compress_flow:exploding_collator"),
            recipe=RecipeArgs(recipe="W4A16"),
            output=OutputArgs(save_directory=str(target)),
        )
    assert str(raised.value).startswith(
        "dataset.data_collator: the collator test_compress_flow:exploding_collator raised while "
        "calibrating: RuntimeError: collator bug found mid-calibration. Fix: fix the collator"
    )
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert not target.exists()
    assert not list(tmp_path.glob(".*staging*"))


def test_a_model_that_fails_verification_is_not_published(tiny_model, tmp_path):
    """W4A16 cannot reproduce the base's logits exactly: with min_cosine 1.0 it must fail."""
    target = tmp_path / "out"
    with pytest.raises(VerificationError) as raised:
        compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=small_data(),
            recipe=RecipeArgs(recipe="W4A16"),
            output=OutputArgs(save_directory=str(target)),
            verify=VerifyArgs(min_cosine=1.0),
        )
    message = str(raised.value)
    assert message.startswith("verify: the compressed model failed verification")
    assert "logits: cosine 0.9" in message and "(min 1.0)" in message
    assert "Fix:" in message and "verify.min_cosine" in message
    assert not target.exists()
    assert not list(tmp_path.iterdir()), "staging folder or reference logits left behind"


AWQ = """
quant_stage:
  quant_modifiers:
    AWQModifier: {}
    QuantizationModifier: {ignore: [lm_head], scheme: W4A16_ASYM, targets: [Linear]}
"""


def test_a_library_failure_during_calibration_names_the_field_and_publishes_nothing(
    tiny_model, tmp_path, monkeypatch
):
    """AWQ fails inside oneshot on CPU-only torch (it pins memory). The hardware check refuses it
    first; with that check out of the way it stands for any failure no check foresaw."""
    monkeypatch.setattr("compressflow.flows.checks.refuse_unsupported", no_hardware_check)
    target = tmp_path / "out"
    with pytest.raises(CalibrationError) as raised:
        compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=small_data(),
            recipe=RecipeArgs(recipe=AWQ),
            output=OutputArgs(save_directory=str(target)),
        )
    message = str(raised.value)
    assert message.startswith("recipe.recipe: llm-compressor failed while calibrating")
    assert "Fix:" in message
    assert not target.exists()
    assert not list(tmp_path.iterdir()), "staging folder or reference logits left behind"
