"""Staging and sealing: how a run's output reaches the output path, and what a killed run leaves.

A run saves its checkpoint into a hidden staging folder beside the output (with its reference
logits and compile cache beside that), and `seal` moves the staged folder to the output in one
`rename`: a reader never sees a partial model, and a failed or killed run leaves nothing at the
output path. `seal` is the one step that commits a staged folder to the output; a folder that
already holds another model is never replaced unless it is an earlier compressflow output (it
holds our manifest) and `overwrite` is asked for. What a killed run leaves beside the output
(staging, offload and retired folders) the next run removes (`remove_leftovers`).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import uuid
from pathlib import Path, PurePosixPath

from compressflow.errors import PublishError
from compressflow.logs import run_logger
from compressflow.store.manifest import (
    MANIFEST,
    not_ours,
    read_manifest,
    refuse_unpublished,
)


def staging_path(target: Path) -> Path:
    """A fresh hidden folder beside `target` (same filesystem, so publishing is one rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent / staging_name(target, os.getpid(), uuid.uuid4().hex[:8])


def staging_name(target: Path, pid: int, tag: str) -> str:
    return f".{target.name}.staging-{pid}-{tag}"


PID_MAX = 4194304  # Linux's largest pid_max: the longest pid a leftover's name can carry


def reference_path(staging: Path) -> Path:
    """The base model's reference logits: beside the staging folder, never published."""
    return staging.with_name(staging.name + ".reference.safetensors")


def remove_staging(staging: Path) -> None:
    """Delete a staging folder this run made, with what lies beside it (reference logits,
    compile cache); what is already gone (published by rename, or removed) is skipped."""
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(compile_cache_path(staging), ignore_errors=True)
    try:
        reference_path(staging).unlink(missing_ok=True)
    except OSError as exc:  # a cleanup's error must not replace the run's own
        run_logger(__name__).warning("Could not remove %s: %s", reference_path(staging), exc)


def compile_cache_path(staging: Path) -> Path:
    """The run's own torch.compile cache: beside the staging folder, gone with the run.

    torch's default cache is shared by every process of the host, and a run killed while it
    compiles (AutoRound compiles) leaves a truncated library there that fails every later
    compile on the host; a run's own cache goes with the run, or with a killed run's leftovers.
    """
    return staging.with_name(staging.name + ".compile")


# The hidden names a run gives what it keeps beside its output, after `.<output name>.`: the
# staging folder (and its reference logits), the offload folder (compressflow.model.memory) and
# an output being replaced. Each carries the pid of the run that made it.
LEFTOVERS = {
    # .reference.pt: what runs before the safetensors reference left
    "staging": r"staging-(\d{1,9})-[0-9a-f]{8}(\.reference\.(pt|safetensors)|\.compile)?",
    "offload": r"offload-(\d{1,9})",
    "retired": r"retired-(\d{1,9})-[0-9a-f]{8}",
}


def leftover_owner(target: Path, path: Path) -> tuple[str, int] | None:
    """(kind, pid) when `path` is named as a run names its hidden folders beside `target`."""
    prefix = f".{target.name}."
    if path.name.startswith(prefix):
        for kind, pattern in LEFTOVERS.items():
            if match := re.fullmatch(pattern, path.name.removeprefix(prefix)):
                return kind, int(match[1])
    return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_leftovers(target: Path) -> None:
    """Delete what runs of `target` killed midway left beside it (staging and offload folders
    can hold a full copy of the weights). Called under the output's lock; only our names, only
    when their process is gone, a retired folder only while it still holds our manifest."""
    log = run_logger(__name__)
    for path in sorted(target.parent.glob(f".{glob.escape(target.name)}.*")):
        owner = leftover_owner(target, path)
        if owner is None or alive(owner[1]) or path.is_symlink():  # we never make links
            continue
        kind, pid = owner
        if kind == "retired" and read_manifest(path) is None:
            continue
        if kind == "retired":
            delete_output(path)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log.info("Removed %s (%s), left by pid %d, which is gone", path, kind, pid)


def delete_output(folder: Path) -> None:
    """Delete a retired output: the files its manifest lists, the manifest last (a deletion cut
    short stays recognisable), then the folders that held them, once empty. Anything else in it
    stays, and so does the folder, which the log names."""
    manifest = read_manifest(folder)
    if manifest is None or manifest.files is None:
        run_logger(__name__).warning("Left %s: its manifest does not list its files", folder)
        return
    for name in sorted(manifest.files, key=lambda n: n == MANIFEST):
        path = folder / name
        # Under a folder that became a link, the name would reach outside the output.
        if any((folder / p).is_symlink() for p in PurePosixPath(name).parents if str(p) != "."):
            continue
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
    held = {folder / p for name in manifest.files for p in PurePosixPath(name).parents}
    for path in sorted(held, key=lambda p: len(p.parts), reverse=True):
        try:
            path.rmdir()
        except OSError:  # not empty, or not a real folder: not ours to remove
            pass
    if folder.exists():
        run_logger(__name__).warning(
            "Left %s: it holds files the replaced output did not publish", folder
        )


def _fsync_tree(folder: Path) -> None:
    # Without this a power loss after the rename can publish a folder of empty files.
    for file in folder.rglob("*"):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())


def seal(staging: Path, target: Path, overwrite: bool) -> None:
    """Move `staging` to `target` in one rename; with overwrite, swap an earlier output of ours
    out first (never a folder without our manifest)."""
    _fsync_tree(staging)
    if not target.exists():
        staging.rename(target)
        return
    if target.is_dir() and not any(target.iterdir()):
        staging.rename(target)  # rename(2) replaces an empty folder in one step
        return
    manifest = read_manifest(target)
    if manifest is None:
        raise PublishError(
            "output.save_directory",
            f"{target} was filled while this run calibrated, with {not_ours(target)} that "
            f"compressflow did not publish (no readable {MANIFEST}); nothing was published",
            "find out what writes there, then pick another save_directory or empty that folder",
        )
    if not overwrite:
        raise PublishError(
            "output.save_directory",
            f"{target} was filled by another run while this one calibrated",
            "rerun (it will reuse that output if it matches) or pick another folder",
        )
    refuse_unpublished(target, manifest)  # files may have been added while this run calibrated
    # The pid lets remove_leftovers tell a killed run's retired folder from a live one's.
    retired = target.parent / f".{target.name}.retired-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    target.rename(retired)
    staging.rename(target)
    delete_output(retired)
