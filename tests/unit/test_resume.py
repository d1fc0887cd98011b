"""A long calibration survives a crash: it resumes from the last finished layer (issue #24).

These drive oneshot through the resumable pipeline, in process, and check what a checkpoint may
and may not be used for; a resumed calibration equals an uninterrupted one, tensor for tensor.
The flow killed and rerun: tests/matrix/test_resume_after_kill.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compressflow import compat
from compressflow.calibration import resume
from compressflow.calibration.pipeline import resumable_pipeline
from compressflow.calibration.resume import CalibrationCheckpoint
from compressflow.data.local_text import python_docs
from compressflow.params import RecipeArgs
from compressflow.recipes.render import render
from compressflow.store import identity

# Checkpoints are discarded only below the cache root's calibration-resume folder: each test's
# own (conftest's `cache_in_tmp_path`).
pytestmark = pytest.mark.usefixtures("cache_in_tmp_path")

KEY = identity.resume_key(run="test")


class Stop(Exception):
    """Ends calibration after a number of subgraphs, in process."""


def calibrate(model_path: Path, folder: Path, interval_s: float, stop_after: int | None = None):
    """oneshot W8A8 (SmoothQuant, then GPTQ: two sequential passes) on `model_path` through the
    resumable pipeline; the calibrated state dict, or None when stopped."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = Dataset.from_dict(tokenizer(python_docs()[:16], truncation=True, max_length=64))
    model = AutoModelForCausalLM.from_pretrained(model_path)
    checkpoint = CalibrationCheckpoint(folder, KEY, interval_s)
    done = checkpoint.subgraph_done

    def counting(*args):
        done(*args)
        counting.calls += 1
        if counting.calls == stop_after:
            raise Stop

    counting.calls = 0
    checkpoint.subgraph_done = counting
    try:
        with (
            compat.restored_torch_functions(),
            resumable_pipeline(checkpoint, independent=True) as pipeline,
        ):
            oneshot(
                model=model,
                processor=tokenizer,
                recipe=render(RecipeArgs(preset="W8A8")).yaml,
                dataset=data,
                num_calibration_samples=len(data),
                shuffle_calibration_samples=False,
                batch_size=4,
                pipeline=pipeline,
            )
    except Stop:
        return None
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory):
    return calibrate(tiny_model, tmp_path_factory.mktemp("off") / "calibration-resume" / "x", -1)


def checkpoint_folder(tmp_path: Path) -> Path:
    return tmp_path / "calibration-resume" / "run"


def test_resumed_calibration_equals_an_uninterrupted_one(tiny_model, tmp_path, uninterrupted):
    folder = checkpoint_folder(tmp_path)
    # 3 subgraphs a pass: stopped in the GPTQ pass, after its first subgraph.
    assert calibrate(tiny_model, folder, 0, stop_after=4) is None
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["next_pass"], manifest["next_subgraph"]) == (1, 1)

    resumed = calibrate(tiny_model, folder, 0)
    assert resumed.keys() == uninterrupted.keys()
    different = [name for name in resumed if not torch.equal(resumed[name], uninterrupted[name])]
    assert different == []


def test_no_checkpoint_with_a_negative_interval(tiny_model, tmp_path):
    folder = checkpoint_folder(tmp_path)
    assert calibrate(tiny_model, folder, -1, stop_after=2) is None
    assert not folder.exists()


def saved_after(subgraphs: list[list], folder: Path) -> None:
    """Save once, after every subgraph (a list of modules) of a model made of them."""
    model = torch.nn.ModuleList(torch.nn.ModuleList(modules) for modules in subgraphs)
    checkpoint = CalibrationCheckpoint(folder, KEY, 3600)
    for index, modules in enumerate(subgraphs):
        checkpoint.subgraph_done(model, 0, index, len(subgraphs), modules, None)
    checkpoint.save(model, 0, len(subgraphs) - 1, len(subgraphs), None)


def peak_growth_mb(action) -> float:
    """How far this process's peak RSS rose above its RSS while `action` ran."""

    def status(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if field in x)
        return int(line.split()[1]) // 1024

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    before = status("VmRSS")
    action()
    return status("VmHWM") - before


def test_a_save_holds_no_copy_of_the_weights_it_writes(tmp_path):
    # A save copied every weight finished since the last one (at 600 s on a GPU, much of the
    # model) before writing: a Llama-3.2-1B-shaped run peaked 0.8 GB above the bare script.
    modules = [torch.nn.Linear(1024, 4096) for _ in range(8)]  # 16 MB each, 128 MB in all
    folder = checkpoint_folder(tmp_path)
    assert peak_growth_mb(lambda: saved_after([[m] for m in modules], folder)) < 48
    assert sorted(p.name for p in (folder / "layers").iterdir()) == [
        f"p0-s{index}.safetensors" for index in range(8)
    ]
    restored = [torch.nn.Linear(1024, 4096) for _ in range(8)]
    model = torch.nn.ModuleList(torch.nn.ModuleList([m]) for m in restored)
    CalibrationCheckpoint(folder, KEY, 3600).restore(model, 0)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(modules, restored, strict=True))


def test_tied_and_partial_tensors_are_saved_as_they_are(tmp_path):
    # safetensors refuses tensors that share memory, and writes a view of part of a larger one
    # from where it starts: those two are copied first.
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    second.weight = first.weight
    first.register_buffer("part", torch.arange(32.0)[8:16])
    folder = checkpoint_folder(tmp_path)
    saved_after([[first, second]], folder)
    written = load_file(folder / "layers" / "p0-s0.safetensors")
    assert torch.equal(written["0.0.weight"], written["0.1.weight"])
    assert torch.equal(written["0.0.part"], torch.arange(8.0, 16.0))


@pytest.fixture()
def saved(tiny_model, tmp_path) -> Path:
    """A checkpoint of the first two subgraphs."""
    folder = checkpoint_folder(tmp_path)
    assert calibrate(tiny_model, folder, 0, stop_after=2) is None
    return folder


def corrupt_layer(folder: Path) -> None:
    layer = next((folder / "layers").glob("*.safetensors"))
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))


def discarded(folder: Path, caplog, key: dict) -> str:
    """Open the checkpoint in `folder` with `key`; the warning, after checking nothing is used."""
    with caplog.at_level(logging.WARNING):
        checkpoint = CalibrationCheckpoint(folder, key, 0)
    assert checkpoint.resume_at() is None
    assert not folder.exists()
    assert "Discarding the calibration checkpoint" in caplog.text
    return caplog.text


def test_a_checkpoint_of_other_inputs_is_discarded(saved, caplog):
    assert "(recipe differ)" in discarded(saved, caplog, {**KEY, "recipe": "another"})


def test_a_checkpoint_of_another_library_version_is_discarded(saved, caplog, monkeypatch):
    versions, code = identity.library_versions(), identity.code_identity()
    monkeypatch.setattr(identity, "library_versions", lambda: {**versions, "torch": "0.0"})
    monkeypatch.setattr(identity, "code_identity", lambda: code)  # the libraries alone differ
    assert "(libraries differ)" in discarded(saved, caplog, identity.resume_key(run="test"))


def test_a_corrupt_checkpoint_is_discarded(saved, caplog):
    layer = next((saved / "layers").glob("*.safetensors"))
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    assert f"{layer.relative_to(saved)} is missing or corrupt" in discarded(saved, caplog, KEY)


def test_an_unreadable_checkpoint_is_discarded(saved, caplog):
    (saved / "manifest.json").write_text("{")
    assert "it cannot be read" in discarded(saved, caplog, KEY)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_usable(
    tiny_model, saved, monkeypatch
):
    before = json.loads((saved / "manifest.json").read_text())

    def dies_half_way(tensors, path):
        Path(path).write_bytes(b"half a file")
        raise OSError("killed")

    monkeypatch.setattr("safetensors.torch.save_file", dies_half_way)
    with pytest.raises(OSError, match="killed"):
        calibrate(tiny_model, saved, 0)
    monkeypatch.undo()

    checkpoint = CalibrationCheckpoint(saved, KEY, 0)
    assert checkpoint.resume_at() == (before["next_pass"], before["next_subgraph"]) == (0, 2)
    assert json.loads((saved / "manifest.json").read_text()) == before


def test_a_checkpoint_naming_files_outside_its_folder_is_discarded(saved, caplog, tmp_path):
    outside = tmp_path / "user-file.txt"
    outside.write_text("the user's")
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["acts"] = "../user-file.txt"
    (saved / "manifest.json").write_text(json.dumps(manifest))
    assert "names files this project does not write" in discarded(saved, caplog, KEY)
    assert outside.read_text() == "the user's"


def test_discard_removes_only_checkpoint_folders(tmp_path):
    user = tmp_path / "models" / "mine"
    user.mkdir(parents=True)
    resume.discard(user)
    assert user.exists()
    elsewhere = tmp_path / "models" / resume.ROOT / "key"  # our folder's name, not our folder
    elsewhere.mkdir(parents=True)
    resume.discard(elsewhere)
    assert elsewhere.exists()
    ours = tmp_path / resume.ROOT / "key" / "recipe"
    ours.mkdir(parents=True)
    resume.discard(ours)
    assert not ours.exists()
    resume.discard(tmp_path / resume.ROOT)  # the root itself
    assert (tmp_path / resume.ROOT).exists()


def test_checkpoints_no_run_came_back_for_expire_and_nothing_else(tmp_path):
    week = 7 * 86400
    old = time.time() - week - 60

    def run_folder(name: str, age: float) -> Path:
        folder = tmp_path / resume.ROOT / name / "recipe"
        (folder / "layers").mkdir(parents=True)
        (folder / "layers" / "p0-s0.safetensors").write_bytes(b"x")
        for path in (folder / "layers" / "p0-s0.safetensors", folder / "layers", folder):
            os.utime(path, (age, age))
        os.utime(folder.parent, (age, age))
        return folder.parent

    stale = run_folder("crashed-long-ago", old)
    live = run_folder("saved-an-hour-ago", old)
    os.utime(live / "recipe" / "layers" / "p0-s0.safetensors", (time.time() - 3600,) * 2)
    user = tmp_path / "users-model"  # linked in: its age is not ours to judge, nor its files
    user.mkdir()
    (user / "weights.safetensors").write_bytes(b"w")
    os.utime(user, (old, old))
    (tmp_path / resume.ROOT / "link").symlink_to(user, target_is_directory=True)

    assert resume.expire(week) == [stale]
    assert not stale.exists() and live.exists()
    assert (user / "weights.safetensors").exists() and (tmp_path / resume.ROOT / "link").exists()
    assert resume.expire(week) == []


def test_a_calibration_expires_stale_checkpoints_as_the_setting_says(tmp_path, monkeypatch, caplog):
    from types import SimpleNamespace

    from compressflow.calibration.run import calibration_checkpoint

    stale = tmp_path / resume.ROOT / "two-days-old"
    stale.mkdir(parents=True)
    os.utime(stale, (time.time() - 2 * 86400,) * 2)
    no_checkpoints = SimpleNamespace(checkpoint_folder=None)
    with caplog.at_level(logging.INFO):
        assert calibration_checkpoint(None, None, None, no_checkpoints, {}) is None
    assert stale.exists()  # the default keeps a week
    monkeypatch.setenv("COMPRESSFLOW_CHECKPOINT_RETENTION_DAYS", "1")
    with caplog.at_level(logging.INFO):
        calibration_checkpoint(None, None, None, no_checkpoints, {})
    assert not stale.exists()
    removed = f"Removed calibration checkpoint {stale}: nothing saved into it within "
    assert removed + "COMPRESSFLOW_CHECKPOINT_RETENTION_DAYS (1)" in caplog.text


def test_the_plan_checks_the_checkpoints_disk_cost(tmp_path, monkeypatch):
    from compressflow.errors import ResourceError
    from compressflow.params import CalibrationArgs
    from compressflow.results import BuiltDataset, MemoryPlan
    from compressflow.tasks.plan_memory import with_checkpoints

    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path))
    recipe, data = render(RecipeArgs(preset="W8A8")), BuiltDataset.model_construct()

    def planned(weight_bytes: int, interval: float = 600) -> MemoryPlan:
        plan = MemoryPlan.model_construct(
            path="classic", weight_bytes=weight_bytes, activation_bytes=5, checkpoint_folder=""
        )
        args = CalibrationArgs(checkpoint_interval_s=interval)
        return with_checkpoints(plan, recipe, data, RecipeArgs(preset="W8A8"), args, "k" * 64)

    plan = planned(100)
    assert plan.checkpoint_bytes == 2 * 100 + 5  # two sequential passes (SmoothQuant, GPTQ)
    assert Path(plan.checkpoint_folder) == tmp_path / resume.ROOT / ("k" * 32)
    assert planned(100, interval=-1).checkpoint_folder == ""
    with pytest.raises(ResourceError, match="calibration.checkpoint_interval_s"):
        planned(2**60)


def test_a_checkpoint_resumes_under_another_thread_share(tmp_path):
    """A crashed run on a busy host comes back with another share of its CPUs (and a share
    changes during a run anyway): that is no reason to start over."""
    from types import SimpleNamespace

    from compressflow.calibration.run import calibration_checkpoint

    inputs = (
        SimpleNamespace(identity="sha256:model", model_class="LlamaForCausalLM"),
        SimpleNamespace(fingerprint="data"),
        SimpleNamespace(sha256="r" * 64),
        SimpleNamespace(
            checkpoint_folder=str(tmp_path / resume.ROOT / "run"),
            checkpoint_interval_s=0,
            device="cpu",
        ),
        {"max_seq_length": 128},
    )
    threads = torch.get_num_threads()
    try:
        keys = []
        for count in (1, 3):
            torch.set_num_threads(count)
            keys.append(calibration_checkpoint(*inputs).key)
    finally:
        torch.set_num_threads(threads)
    assert keys[0] == keys[1]
