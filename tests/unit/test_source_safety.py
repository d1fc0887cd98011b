"""Safe to run unattended: the source model is never written to, publishing deletes only an earlier
output of ours (known by its manifest), and what a killed run leaves beside the output is removed
by the next run, never a live run's folder nor a user's (the flow doing so:
tests/e2e/test_offload_leftovers.py)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
from support.processes import dead_pid
from support.reports import evaluation_report

from compressflow.errors import InputError, PublishError
from compressflow.flows.checks import resolve_inputs
from compressflow.flows.validate import validate
from compressflow.inputs import RunArgs
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from compressflow.results import Verification
from compressflow.store import staging as store_staging
from compressflow.store.identity import file_digests
from compressflow.store.locks import lock_path
from compressflow.store.manifest import (
    CARD,
    MANIFEST,
    Manifest,
    ManifestResult,
    hashed_files,
    read_manifest,
    write_manifest,
)
from compressflow.store.output import check_apart, check_output_path, check_target, find_published
from compressflow.store.staging import leftover_owner, remove_leftovers, seal

DATA = DatasetArgs(dataset_name="python_docs", text_samples=8, max_seq_len=64)


def an_output(folder: Path, scheme: str = "W4A16", listed: bool = True) -> Path:
    """A folder as compressflow publishes it: a checkpoint, its recipe, a card and our manifest,
    which lists them and records the checkpoint's and recipe's sha256."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text("an earlier output")
    (folder / "recipe.yaml").write_text("quant_stage: {}\n")
    (folder / CARD).write_text("# made by compressflow\n")
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
        verification=Verification(passed=True, checks=[]),
        # Manifests before compressflow recorded what it published do not list it.
        files=[CARD, MANIFEST, "model.safetensors", "recipe.yaml"] if listed else None,
        file_sha256=file_digests(folder, hashed_files(folder)) if listed else None,
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
            RunArgs(
                model=ModelArgs(model_id=str(source)),
                dataset=DATA,
                recipe=RecipeArgs(recipe="W4A16"),
                output=OutputArgs(save_directory=str(where(source)), overwrite=True),
            ),
        )
    message = str(raised.value)
    resolved = where(source).resolve()
    assert message.startswith(f"output.save_directory: {resolved} {how} the source model's")
    assert str(source.resolve()) in message and "Fix: choose a save_directory outside" in message
    # Refused by the precheck, in the flow's own process: not even the recipe was rendered.
    assert stages == [], "a stage ran (the model was fetched and hashed) before the refusal"
    assert files(source) == before


def test_output_inside_the_hub_cache_folder_is_refused_before_the_dataset_builds(hub_cache):
    stages: list[str] = []

    def run(stage, *args):
        stages.append(stage.name)
        return stage.fn(*args)

    for inside in (hub_cache / "snapshots" / "out", hub_cache / "blobs"):
        with pytest.raises(
            PublishError, match=f"the source model's folder \\(model.model_id\\): {hub_cache}"
        ):
            resolve_inputs(
                run,
                RunArgs(
                    model=ModelArgs(model_id="acme/tiny-llama"),
                    dataset=DATA,
                    recipe=RecipeArgs(recipe="W4A16"),
                    output=OutputArgs(save_directory=str(inside), overwrite=True),
                ),
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
    sources = [("the source model's folder", src)]
    for offload, what in [
        (src, "source model's"),
        (src / "tmp", "source model's"),
        (out, "output"),
    ]:
        with pytest.raises(InputError) as raised:
            check_apart(out, sources, str(offload))
        assert str(raised.value).startswith(f"calibration.offload_folder: {offload.resolve()}")
        assert f"the {what} folder" in str(raised.value)
    check_apart(out, sources, str(tmp_path))  # a folder that holds the output is fine
    check_apart(out, sources, "")


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
    deleting = store_staging.delete_output
    monkeypatch.setattr(store_staging, "delete_output", lambda f: (retired.append(f), deleting(f)))
    seal(staging, target, overwrite=True)
    assert files(target) == {"config.json": b"{}"}
    assert [leftover_owner(target, f) for f in retired] == [("retired", os.getpid())]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_refuses_an_earlier_output_holding_files_it_did_not_publish(tmp_path):
    target = an_output(tmp_path / "out")
    (target / "eval").mkdir()
    (target / "eval" / "results.json").write_text("mine")
    (target / "notes.md").write_text("mine too")
    before = files(target)
    with pytest.raises(PublishError) as raised:
        check_target(target, "another key", overwrite=True)
    message = str(raised.value)
    assert message.startswith("output.save_directory: ")
    assert (
        "3 entries the earlier compressflow output did not publish (eval, eval/results.json, "
        "notes.md); replacing it would delete them"
    ) in message
    assert "Fix: move them out of that folder, or choose another save_directory" in message
    # Added while a run calibrated: sealing checks again and moves nothing.
    staging = tmp_path / ".out.staging"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    with pytest.raises(PublishError, match="replacing it would delete them"):
        seal(staging, target, overwrite=True)
    assert files(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.staging", "out"]


def test_overwrite_refuses_an_output_whose_manifest_does_not_list_its_files(tmp_path):
    target = an_output(tmp_path / "out", listed=False)
    with pytest.raises(PublishError, match="did not record the files it published") as raised:
        check_target(target, "another key", overwrite=True)
    assert "delete it yourself, or choose another save_directory" in str(raised.value)


def test_a_manifest_naming_files_outside_its_folder_is_not_ours(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep")
    for name in ["../precious.txt", str(precious), "a/../../precious.txt", "./x", ""]:
        target = an_output(tmp_path / f"out-{abs(hash(name))}")
        manifest = json.loads((target / MANIFEST).read_text())
        (target / MANIFEST).write_text(json.dumps({**manifest, "files": [name]}))
        assert read_manifest(target) is None, name
        with pytest.raises(PublishError, match="compressflow did not publish"):
            check_target(target, "another key", overwrite=True)
        store_staging.delete_output(target)
        assert precious.read_text() == "keep"


def test_a_manifest_that_is_a_fifo_is_not_read(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    os.mkfifo(target / MANIFEST)  # opening it would block until a writer came
    assert read_manifest(target) is None
    with pytest.raises(PublishError, match="compressflow did not publish"):
        check_target(target, "key", overwrite=True)


def test_deleting_a_retired_output_deletes_only_what_it_published(tmp_path, caplog):
    folder = an_output(tmp_path / ".out.retired-1-0123abcd")
    (folder / "added-after-the-check.txt").write_text("mine")
    (tmp_path / "elsewhere").mkdir()
    (folder / "link").symlink_to(tmp_path / "elsewhere")
    with caplog.at_level("WARNING", logger=store_staging.__name__):
        store_staging.delete_output(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["added-after-the-check.txt", "link"]
    assert f"Left {folder}: it holds files the replaced output did not publish" in caplog.text
    store_staging.delete_output(an_output(tmp_path / "whole"))
    assert not (tmp_path / "whole").exists()


def test_an_output_name_too_long_for_the_runs_working_files_is_refused(tmp_path):
    longest = 255 - len(".staging-4194304-ffffffff.reference.safetensors") - 1
    check_output_path(tmp_path / ("n" * longest))
    with pytest.raises(PublishError) as raised:
        check_output_path(tmp_path / ("n" * (longest + 1)))
    message = str(raised.value)
    assert message.startswith("output.save_directory: its last part, nnnn")
    assert f"is {longest + 1} bytes long" in message
    assert f"Fix: choose a save_directory whose last part is at most {longest} bytes" in message


def test_an_output_or_offload_folder_under_a_file_is_refused(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    with pytest.raises(PublishError, match=f"{a_file}/out lies under {a_file}, which is a file"):
        check_output_path(a_file / "out")
    with pytest.raises(PublishError, match=f"{a_file} is {a_file}, which is a file"):
        check_output_path(a_file)
    with pytest.raises(InputError, match=f"calibration.offload_folder: {a_file} is a file"):
        check_apart(tmp_path / "out", [("the source", tmp_path / "src")], str(a_file))
    assert a_file.read_text() == "mine"


def test_a_tokenizer_file_linking_out_of_the_model_folder_is_not_published(tmp_path):
    from compressflow.calibration.run import copy_preprocessing_files

    secret = tmp_path / "home" / ".clearml.conf"
    secret.parent.mkdir()
    secret.write_text("api { credentials { secret_key: s3cr3t } }")
    local = tmp_path / "local-model"
    local.mkdir()
    (local / "tokenizer_config.json").write_text("{}")
    (local / "tokenizer_extra.json").symlink_to(secret)
    # A hub snapshot: its files link into the repository's blobs, which is its own.
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "0123").write_text('{"merges": []}')
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(Path("../../blobs/0123"))
    for source, published in [(local, ["tokenizer_config.json"]), (snapshot, ["tokenizer.json"])]:
        staging = tmp_path / f"staging-{source.name}"
        staging.mkdir()
        copy_preprocessing_files(source, staging)
        assert sorted(p.name for p in staging.iterdir()) == published
        assert not any(p.is_symlink() for p in staging.iterdir())


# --- A reused output is the one published --------------------------------------------------


def changed_byte(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[3] ^= 1
    weights.write_bytes(bytes(data))


def same_bytes_new_inode(folder: Path) -> None:  # a copy back in place, as rsync or cp leave it
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    weights.write_bytes(data)


def link_to_same_bytes(folder: Path) -> None:
    copy = folder.parent / "copy.safetensors"
    shutil.copy(folder / "model.safetensors", copy)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(copy)


def replaced_by(kind):
    def replace(folder: Path) -> None:
        weights = folder / "model.safetensors"
        weights.unlink()
        os.mkfifo(weights) if kind == "fifo" else weights.mkdir()

    return replace


WEIGHTS = "model.safetensors"
NOTES = "notes.txt"
CHANGES = {
    "one byte": (changed_byte, f"{WEIGHTS}: other bytes"),
    "truncated": (lambda f: (f / WEIGHTS).write_bytes(b""), f"{WEIGHTS}: other bytes"),
    "removed": (lambda f: (f / WEIGHTS).unlink(), f"{WEIGHTS}: missing"),
    # The link's target is not the folder's to keep: it may change under it.
    "a link to the same bytes": (link_to_same_bytes, f"{WEIGHTS}: no longer a plain file"),
    "a FIFO": (replaced_by("fifo"), f"{WEIGHTS}: no longer a plain file"),  # never opened
    "a folder": (replaced_by("folder"), f"{WEIGHTS}: no longer a plain file"),
    "the recipe edited": (
        lambda f: (f / "recipe.yaml").write_text("x: 1\n"),
        "recipe.yaml: other bytes",
    ),
    # vLLM loads every *.safetensors of a folder without an index: a stray one is loaded too.
    "a file added": (
        lambda f: (f / "extra.safetensors").write_bytes(b"{}"),
        "extra.safetensors: added",
    ),
    "the card a FIFO": (
        lambda f: ((f / CARD).unlink(), os.mkfifo(f / CARD)),
        f"{CARD}: no longer a plain file",
    ),
}


@pytest.mark.parametrize("change, found", CHANGES.values(), ids=CHANGES.keys())
def test_an_output_that_changed_since_publishing_is_not_reused(tmp_path, change, found):
    target = an_output(tmp_path / "out")
    assert find_published(target, "k").reused
    change(target)
    before = entries(target)
    assert find_published(target, "k") is None
    with pytest.raises(PublishError) as raised:
        check_target(target, "k", overwrite=False)
    message = str(raised.value)
    assert f"from these same inputs, but it changed since ({found}): not what" in message
    assert "Fix: set output.overwrite: true to calibrate and publish it anew" in message
    if "added" not in found:
        check_target(target, "k", overwrite=True)  # ours, as published: replaceable
    else:  # replacing it would delete the file added
        with pytest.raises(PublishError, match="replacing it would delete them"):
            check_target(target, "k", overwrite=True)
    assert entries(target) == before


def entries(folder: Path) -> dict[str, int]:
    """Every entry's name and mode, links not followed: a FIFO is never opened."""
    return {str(p.relative_to(folder)): p.lstat().st_mode for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "change",
    [
        same_bytes_new_inode,
        lambda f: (f / CARD).write_text("# made by compressflow\n\n## Eval\n"),
        lambda f: (f / CARD).unlink(),
    ],
    ids=["same bytes, new inode", "the card edited", "the card removed"],
)
def test_an_output_is_reused_while_it_holds_the_bytes_published(tmp_path, change):
    target = an_output(tmp_path / "out")
    change(target)
    assert find_published(target, "k").reused
    check_target(target, "k", overwrite=False)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.pop("file_sha256"),
        lambda m: m["file_sha256"].pop(WEIGHTS),  # its weights then unchecked
        lambda m: m.pop("files"),
    ],
    ids=["no hashes", "one hash dropped", "no file list"],
)
def test_an_output_whose_manifest_does_not_hash_each_file_is_not_reused(tmp_path, edit):
    # An earlier version's output, or a manifest edited: its bytes cannot be checked.
    target = an_output(tmp_path / "out")
    manifest = json.loads((target / MANIFEST).read_text())
    edit(manifest)
    (target / MANIFEST).write_text(json.dumps(manifest))
    changed_byte(target)
    assert find_published(target, "k") is None
    with pytest.raises(PublishError, match="does not record the sha256 of each of its files"):
        check_target(target, "k", overwrite=False)


def test_a_manifest_hashing_a_file_outside_its_folder_is_not_ours(tmp_path):
    (tmp_path / "precious.txt").write_text("keep")
    target = an_output(tmp_path / "out")
    manifest = json.loads((target / MANIFEST).read_text())
    manifest["file_sha256"]["../precious.txt"] = "0" * 64
    (target / MANIFEST).write_text(json.dumps(manifest))
    assert read_manifest(target) is None


def republished(folder: Path) -> None:
    earlier = read_manifest(folder)
    write_manifest(folder, earlier.model_copy(update={"created_at": "2025-02-01T00:00:00+00:00"}))


def held_by_another_run(folder: Path):
    """A compress run republishing `folder`: it holds the folder's lock until the test's end."""
    handle = open(lock_path(folder), "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


@pytest.mark.parametrize(
    "meanwhile, why",
    [
        (republished, "it was published anew while this evaluation ran"),
        (changed_byte, "it changed since it was published (model.safetensors: other bytes)"),
        (held_by_another_run, "is still being written by another run"),
    ],
    ids=["republished", "a file changed", "being republished"],
)
def test_an_evaluation_is_recorded_only_in_the_folder_it_scored(
    tmp_path, caplog, monkeypatch, meanwhile, why
):
    from compressflow.flows import evaluate

    monkeypatch.setattr(evaluate, "RECORD_WAIT_SECONDS", 0.1)
    target = an_output(tmp_path / "out")
    scored = read_manifest(target)
    evaluate.record_evaluation(
        target, scored, evaluation_report(str(target)), "base", "transformers"
    )
    assert read_manifest(target).evaluation == evaluation_report(str(target))
    assert "## Evaluation" in (target / CARD).read_text()

    other = an_output(tmp_path / "other")
    scored = read_manifest(other)
    still_held = meanwhile(other)
    card, manifest = (other / CARD).read_text(), (other / MANIFEST).read_text()
    with caplog.at_level("WARNING"):
        evaluate.record_evaluation(
            other, scored, evaluation_report(str(other)), "base", "transformers"
        )
    assert (other / CARD).read_text() == card and (other / MANIFEST).read_text() == manifest
    assert f"Not recorded in {other}" in caplog.text and why in caplog.text
    if still_held:
        still_held.close()


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

    with caplog.at_level("INFO", logger=store_staging.__name__):
        remove_leftovers(target)

    assert not reference.exists() and not older.exists()
    for name, removed in made.items():
        assert (tmp_path / name).exists() != removed, name
    assert link.is_symlink()
    removed = tmp_path / f".out.offload-{dead}"
    assert f"Removed {removed} (offload), left by pid {dead}, which is gone" in caplog.text
