"""Safe to run unattended: the source model is never written to, publishing deletes only an earlier
output of ours (known by its manifest), and what a killed run leaves beside the output is removed
by the next run, never a live run's folder nor a user's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compressflow.errors import InputError, PublishError
from compressflow.flows.checks import resolve_inputs
from compressflow.flows.validate import validate
from compressflow.params import CalibrationArgs, DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from compressflow.store import manifest as store
from compressflow.store.manifest import (
    MANIFEST,
    Manifest,
    ManifestResult,
    check_apart,
    check_target,
    leftover_owner,
    remove_leftovers,
    seal,
    write_manifest,
)

DATA = DatasetArgs(dataset_name="python_docs", text_samples=8, max_seq_len=64)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def an_output(folder: Path, scheme: str = "W4A16") -> Path:
    """A folder as compressflow publishes it: a checkpoint file and our manifest."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text("an earlier output")
    result = ManifestResult(
        run_key="k",
        model_identity="sha256:x",
        scheme=scheme,
        size_bytes=1,
        original_size_bytes=2,
        compression_ratio=2.0,
    )
    manifest = Manifest(
        created_at="2025-01-01T00:00:00+00:00",
        result=result,
        inputs={},
        model={},
        dataset=None,
        recipe={},
        libraries={},
        stages=[],
        peak_rss_mb=0.0,
    )
    write_manifest(folder, manifest)
    return folder


@pytest.fixture()
def source(tiny_model, tmp_path) -> Path:
    """A local model folder of the test's own (config and tokenizer; no weights needed)."""
    folder = tmp_path / "models" / "llama"
    shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    return folder


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# --- The source is sacred --------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, how",
    [
        (lambda src: src, "is"),
        (lambda src: src / "compressed", "lies inside"),
        (lambda src: src.parent, "contains"),
        (lambda src: src.parent / "link-to-llama", "is"),  # a symlink to the source
    ],
    ids=["same", "inside", "contains", "symlink"],
)
def test_output_overlapping_a_local_source_is_refused_before_the_model_is_fetched(
    source, where, how
):
    (source.parent / "link-to-llama").symlink_to(source)
    before = files(source)
    stages: list[str] = []

    def run(stage, *args):
        stages.append(stage.name)
        return stage.fn(*args)

    with pytest.raises(PublishError) as raised:
        resolve_inputs(
            run,
            ModelArgs(model_id=str(source)),
            DATA,
            RecipeArgs(recipe="W4A16"),
            OutputArgs(save_directory=str(where(source)), overwrite=True),
            CalibrationArgs(),
        )
    message = str(raised.value)
    resolved = where(source).resolve()
    assert message.startswith(f"output.save_directory: {resolved} {how} the source model's")
    assert str(source.resolve()) in message and "Fix: choose a save_directory outside" in message
    assert stages == ["render recipe"], "the model was fetched (hashed) before the refusal"
    assert files(source) == before


def test_output_inside_the_hub_cache_folder_is_refused_before_the_dataset_builds(hub_cache):
    stages: list[str] = []

    def run(stage, *args):
        stages.append(stage.name)
        return stage.fn(*args)

    for inside in (hub_cache / "snapshots" / "out", hub_cache / "blobs"):
        with pytest.raises(PublishError, match=f"the source model's folder {hub_cache}"):
            resolve_inputs(
                run,
                ModelArgs(model_id="acme/tiny-llama"),
                DATA,
                RecipeArgs(recipe="W4A16"),
                OutputArgs(save_directory=str(inside), overwrite=True),
                CalibrationArgs(),
            )
    assert "build dataset" not in stages and "fetch model" in stages


def test_validate_refuses_an_output_inside_the_source(source):
    with pytest.raises(PublishError, match="output.save_directory: .* lies inside the source"):
        validate(
            model={"model_id": str(source)},
            dataset=DATA.model_dump(),
            recipe={"recipe": "W4A16"},
            output={"save_directory": str(source / "out"), "overwrite": True},
        )
    assert not (source / "out").exists()


def test_an_offload_folder_inside_the_source_or_the_output_is_refused(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    for offload, what in [
        (src, "source model's"),
        (src / "tmp", "source model's"),
        (out, "output"),
    ]:
        with pytest.raises(InputError) as raised:
            check_apart(out, src, str(offload))
        assert str(raised.value).startswith(f"calibration.offload_folder: {offload.resolve()}")
        assert f"the {what} folder" in str(raised.value)
    check_apart(out, src, str(tmp_path))  # a folder that holds the output is fine
    check_apart(out, src, "")


def test_validate_refuses_an_offload_folder_inside_the_source(source, tmp_path):
    with pytest.raises(InputError, match="calibration.offload_folder: .* lies inside the source"):
        validate(
            model={"model_id": str(source)},
            dataset=DATA.model_dump(),
            recipe={"recipe": "W4A16"},
            output={"save_directory": str(tmp_path / "out")},
            calibration={"offload_folder": str(source / "offload")},
        )


# --- Publishing deletes only an earlier output of ours ---------------------------------------


def test_a_folder_without_our_manifest_is_refused_even_with_overwrite(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(PublishError) as raised:
        check_target(target, "key", overwrite=True)
    assert "1 entries (notes.txt), which compressflow did not publish" in str(raised.value)
    assert "replaces only an earlier compressflow output" in str(raised.value)
    check_target(an_output(tmp_path / "ours"), "key", overwrite=True)  # ours: replaceable


def test_sealing_never_moves_away_a_folder_without_our_manifest(tmp_path):
    staging, target = tmp_path / ".out.staging", tmp_path / "out"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(PublishError, match="compressflow did not publish"):
        seal(staging, target, overwrite=True)
    assert files(target) == {"notes.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.staging", "out"]


def test_sealing_over_an_earlier_output_retires_it_under_our_pid(tmp_path, monkeypatch):
    staging, target = tmp_path / ".out.staging", tmp_path / "out"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    an_output(target)
    retired: list[Path] = []
    deleting = store.delete_output
    monkeypatch.setattr(store, "delete_output", lambda f: (retired.append(f), deleting(f)))
    seal(staging, target, overwrite=True)
    assert files(target) == {"config.json": b"{}"}
    assert [leftover_owner(target, f) for f in retired] == [("retired", os.getpid())]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- Clean after a crash ---------------------------------------------------------------------


def test_leftovers_of_dead_runs_are_removed_and_nothing_else(tmp_path, caplog):
    target, dead, live = tmp_path / "out", dead_pid(), os.getpid()
    made = {
        f".out.offload-{dead}": True,
        f".out.offload-{live}": False,  # a live run's
        f".out.staging-{dead}-0123abcd": True,
        f".out.staging-{dead}-0123abcd.compile": True,  # its torch.compile cache
        f".out.staging-{live}-0123abcd.compile": False,
        f".out.retired-{live}-0123abcd": False,  # being deleted by a live run
        f".out.retired-{dead}-89abcdef": False,  # no manifest: not provably an old output
        f".out.retired-{dead}-0123abcd": True,  # an old output of ours
        # Look-alikes a user may have: not our names, never touched.
        ".out.offload-backup": False,
        f".out.offload-{dead}-copy": False,
        f".out.staging-{dead}": False,
        f".out.retired-{dead}": False,
        f".other.offload-{dead}": False,
        f"out.offload-{dead}": False,
    }
    for name in made:
        folder = tmp_path / name
        if name.endswith("0123abcd") and "retired" in name:
            an_output(folder)
        else:
            folder.mkdir()
            (folder / "weights.bin").write_text("a copy of the weights")
    reference = tmp_path / f".out.staging-{dead}-0123abcd.reference.safetensors"
    reference.write_text("logits")
    older = tmp_path / f".out.staging-{dead}-0123abcd.reference.pt"  # before safetensors
    older.write_text("logits")
    link = tmp_path / f".out.offload-{dead_pid()}"  # we never make links: not ours
    link.symlink_to(tmp_path / ".out.offload-backup")

    with caplog.at_level("INFO", logger=store.__name__):
        remove_leftovers(target)

    assert not reference.exists() and not older.exists()
    for name, removed in made.items():
        assert (tmp_path / name).exists() != removed, name
    assert link.is_symlink()
    removed = tmp_path / f".out.offload-{dead}"
    assert f"Removed {removed} (offload), left by pid {dead}, which is gone" in caplog.text


@pytest.mark.usefixtures("prefect_harness")
def test_the_next_run_removes_a_killed_runs_offload_folder_not_a_live_ones(tiny_model, tmp_path):
    from compressflow.flows.compress import compress

    target = tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        leftovers = {
            f".out.offload-{dead_pid()}": False,
            f".out.offload-{live.pid}": True,  # another run, still calibrating
            ".out.offload-mine": True,  # a user's folder with a similar name
        }
        for name in leftovers:
            (tmp_path / name).mkdir()
            (tmp_path / name / "weights.bin").write_text("a copy of the weights")
        published = compress(
            model=ModelArgs(model_id=str(tiny_model)),
            recipe=RecipeArgs(recipe="FP8_DYNAMIC"),
            output=OutputArgs(save_directory=str(target)),
        )
    finally:
        live.kill()
        live.wait()
    assert Path(published.path) == target and (target / MANIFEST).exists()
    for name, kept in leftovers.items():
        assert (tmp_path / name).exists() == kept, name
