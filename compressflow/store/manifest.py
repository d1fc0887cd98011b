"""The on-disk contract of a published model: where it goes, its manifest, and how it is sealed.

A published folder holds the checkpoint, the rendered `recipe.yaml` and a `manifest.json`. It
appears in one `rename` from a staging folder beside it, so a reader never sees a partial model
and a failed or killed run leaves nothing at the output path. A folder that already holds another
model is never replaced unless it is an earlier compressflow output (it holds our manifest) and
`overwrite` is asked for, and an output never overlaps the source model's folder. What a killed
run leaves beside the output (staging, offload and retired folders) the next run removes.

The manifest's `run_key` (`compressflow.store.identity.run_key`) hashes what determines the
result: a later run with the same key finds the published folder and returns it without
calibrating again.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import shutil
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator

from compressflow.errors import InputError, PublishError
from compressflow.limits import MAX_JSON_BYTES, not_regular
from compressflow.logs import run_logger
from compressflow.params import (
    DatasetArgs,
    ModelArgs,
    OutputArgs,
)
from compressflow.results import (
    EvaluationReport,
    FetchedModel,
    LayerTime,
    MemoryPlan,
    ModuleMetric,
    PublishedModel,
    RenderedRecipe,
    StageRecord,
    TargetSearch,
    Verification,
)
from compressflow.settings import settings
from compressflow.store.atomic import write_atomic
from compressflow.store.identity import file_digests

MANIFEST = "manifest.json"
CARD = "README.md"  # the model card (compressflow.reporting.model_card writes it)


class ManifestResult(BaseModel):
    """What the run produced; `PublishedModel` is this plus where the folder is."""

    run_key: str
    model_identity: str
    scheme: str | None
    size_bytes: int
    original_size_bytes: int
    compression_ratio: float


class Manifest(BaseModel):
    """`manifest.json`: everything needed to tell how a published model was made."""

    created_at: str = Field(description="UTC time of publishing, ISO 8601.")
    result: ManifestResult
    inputs: dict[str, dict[str, Any]] = Field(description="The flow's parameter groups.")
    model: dict[str, Any] = Field(description="The fetched model (FetchedModel, without path).")
    dataset: dict[str, Any] | None = Field(description="The built dataset, or None (data-free).")
    recipe: dict[str, Any] = Field(description="The rendered recipe (RenderedRecipe, no YAML).")
    libraries: dict[str, str]
    stages: list[StageRecord]
    calibration_seconds: float | None = Field(default=None, description="oneshot's own time.")
    resumed_from: str | None = Field(
        default=None,
        description="Where calibration resumed from a crashed run's checkpoint ('pass 1, layer "
        "3 of 9'; calibration_seconds then counts the resumed part only); None: from the start.",
    )
    reference_seconds: float | None = Field(
        default=None,
        description="Capturing the base model's logits for verification, before calibration; "
        "None on the model-free path, whose verify pass takes them (its seconds count them).",
    )
    peak_rss_mb: float
    peak_gpu_mb: float | None = None
    modules: list[ModuleMetric] = Field(default_factory=list)
    layers: list[LayerTime] = Field(default_factory=list, description="Seconds per subgraph.")
    tags: list[str] = Field(default_factory=list)
    verification: Verification | None = Field(
        default=None, description="What the verify stage proved before publishing."
    )
    memory_plan: MemoryPlan | None = Field(
        default=None,
        description="The calibration path, where the weights lived, the batch size and the "
        "speed knobs used, and the memory planned for them.",
    )
    target: TargetSearch | None = Field(
        default=None,
        description="Compress to a target: each round's modules left unquantized, held-out "
        "perplexity ratio and size, and the round published.",
    )
    evaluation: EvaluationReport | None = Field(
        default=None,
        description="The latest evaluate-model run on this folder: its metrics, lm-eval "
        "scores with their recovery and backend, and the gate's verdict.",
    )
    files: list[str] | None = Field(
        default=None,
        description="Every file the run published, relative to the folder, manifest.json "
        "included: replacing the output deletes these and nothing else. None in manifests "
        "written before it was recorded; such an output is never replaced.",
    )
    file_sha256: dict[str, str] | None = Field(
        default=None,
        description="sha256 of every published file but the manifest and the model card (which "
        "evaluate-model and a later vLLM check rewrite): a run that would reuse the folder, or "
        "an evaluation that would record its results here, first checks the files are still "
        "these. None in manifests written before it was recorded: such an output cannot be "
        "checked, and is not reused.",
    )

    @field_validator("files", "file_sha256")
    @classmethod
    def _inside(cls, files: list[str] | dict[str, str] | None):
        # A manifest is a file anyone with write access to the folder can edit: the names it
        # lists are deleted on overwrite, or opened and read, so none may point out of it.
        for name in files or []:
            path = PurePosixPath(name)
            if not name or path.is_absolute() or ".." in path.parts or str(path) != name:
                raise ValueError(f"{name!r} is not a plain path inside the output folder")
        return files

    def base_model_args(self) -> ModelArgs | None:
        """The ModelArgs the compressed model was made from."""
        model = self.inputs.get("model")
        return ModelArgs(**model) if model else None

    def calibration_args(self) -> DatasetArgs | None:
        """The calibration DatasetArgs, or None when the recipe used no data (e.g. FP8_DYNAMIC)."""
        return DatasetArgs(**self.inputs["dataset"]) if self.dataset else None


def output_path(output: OutputArgs, model: FetchedModel, recipe: RenderedRecipe) -> Path:
    """`save_directory`, or <$COMPRESSFLOW_OUTPUT_DIR or ./outputs>/<model name>-<scheme>."""
    if output.save_directory:
        return Path(output.save_directory).expanduser().resolve()
    base = settings().output_dir.expanduser().resolve()
    name = re.sub(r"[^\w.-]+", "-", Path(model.model_id.rstrip("/")).name)
    return base / f"{name}-{recipe.scheme or 'compressed'}"


def read_manifest(path: Path) -> Manifest | None:
    """The manifest of a published folder; None when the folder holds no compressflow output
    (no manifest, or one this version cannot read: not a regular file, whose open could block,
    larger than any we write, or not valid)."""
    file = path / MANIFEST
    try:
        if not_regular(file) or file.stat().st_size > MAX_JSON_BYTES:
            return None
        return Manifest.model_validate_json(file.read_bytes())
    except (OSError, ValidationError):
        return None


def entries(folder: Path) -> list[str]:
    """Every file, link and folder under `folder`, relative, links not followed."""
    found = []
    for root, folders, files in os.walk(folder):
        base = PurePosixPath(Path(root).relative_to(folder).as_posix())
        found += [str(base / name) for name in folders + files]
    return sorted(found)


def published_files(staging: Path, *still_to_write: str) -> list[str]:
    """What a run publishes: the files in its staging folder and those it writes last."""
    made = [name for name in entries(staging) if not (staging / name).is_dir()]
    return sorted({*made, *still_to_write})


def not_published(folder: Path, manifest: Manifest) -> list[str] | None:
    """What lies in `folder` that the run of `manifest` did not publish (a user's notes, an
    evaluation's results); None when the manifest does not say what it published."""
    if manifest.files is None:
        return None
    ours = set(manifest.files)
    parents = {str(p) for name in ours for p in PurePosixPath(name).parents if str(p) != "."}
    return [
        name
        for name in entries(folder)
        if name not in ours and not (name in parents and _real_folder(folder / name))
    ]


def _real_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def write_manifest(folder: Path, manifest: Manifest) -> None:
    (folder / MANIFEST).write_text(manifest.model_dump_json(indent=2))


def replace_manifest(folder: Path, manifest: Manifest) -> None:
    """Write the manifest of a published folder anew, atomically (its run holds the output's
    lock, so it is the only writer)."""
    write_atomic(folder / MANIFEST, lambda tmp: tmp.write_text(manifest.model_dump_json(indent=2)))


def published_model(path: Path, manifest: Manifest, reused: bool) -> PublishedModel:
    return PublishedModel(reused=reused, path=str(path), **manifest.result.model_dump())


def hashed_files(folder: Path) -> list[str]:
    """The published files a manifest records the sha256 of: all but the manifest itself and
    the model card, which later runs rewrite."""
    return [name for name in published_files(folder) if name not in (MANIFEST, CARD)]


def changed_files(folder: Path, manifest: Manifest) -> list[str] | None:
    """How a published folder departs from what its run published, one entry each ('model.
    safetensors: other bytes', 'notes.txt: added'); [] when it holds exactly that. A file is
    judged by its bytes alone (a copy of the folder is the same output); a file added counts, as
    a loader may read it (vLLM loads every *.safetensors beside the index-less weights). None when
    the manifest does not record a sha256 for each file it lists (an earlier version's output, or
    a manifest edited): nothing can be told, so nothing is taken as intact."""
    if manifest.files is None or manifest.file_sha256 is None:
        return None
    if set(manifest.file_sha256) != set(manifest.files) - {MANIFEST, CARD}:
        return None
    found = {}
    for name in manifest.file_sha256:
        path = folder / name
        if not os.path.lexists(path):
            found[name] = "missing"
        # Only plain files are opened: a FIFO put in a weight's place would block the read.
        elif path.is_symlink() or not_regular(path):
            found[name] = "no longer a plain file"
    digests = file_digests(folder, sorted(set(manifest.file_sha256) - set(found)))
    for name, digest in digests.items():
        if digest != manifest.file_sha256[name]:
            found[name] = "other bytes"
    for name in [CARD, MANIFEST]:  # rewritten by later runs, so not hashed; a card removed is
        path = folder / name  # no change to the model
        if os.path.lexists(path) and (path.is_symlink() or not_regular(path)):
            found[name] = "no longer a plain file"
    for name in not_published(folder, manifest):
        found[name] = "added"
    return [f"{name}: {why}" for name, why in sorted(found.items())]


def _same_run(manifest: Manifest | None, key: str) -> bool:
    """Whether `manifest` is of a verified output made from exactly the inputs of `key`."""
    verified = manifest and manifest.verification and manifest.verification.passed
    return bool(verified and manifest.result.run_key == key)


def find_published(target: Path, key: str) -> PublishedModel | None:
    """The output already at `target` when it was made from exactly the same inputs and its
    files are still the ones published (check_target says what changed)."""
    manifest = read_manifest(target)
    if not _same_run(manifest, key) or changed_files(target, manifest) != []:
        return None
    return published_model(target, manifest, reused=True)


def check_target(target: Path, key: str, overwrite: bool) -> None:
    """Refuse, before any calibration, to replace a folder that holds something else.

    `overwrite` replaces an earlier compressflow output only (one with our manifest): files we
    did not publish are never moved or deleted.
    """
    if not target.exists():
        return
    if target.is_dir() and not any(target.iterdir()):
        return
    manifest = read_manifest(target)
    if _same_run(manifest, key):
        changed = changed_files(target, manifest)
        if changed == []:
            return  # the run reuses it
        if not overwrite:
            raise PublishError("output.save_directory", *_not_reused(target, changed))
    if manifest and overwrite:
        refuse_unpublished(target, manifest)
        return
    if manifest:
        raise PublishError(
            "output.save_directory",
            f"{target} already holds another compressflow output (model "
            f"{manifest.result.model_identity}, scheme {manifest.result.scheme})",
            "choose another save_directory, or set output.overwrite: true to replace it",
        )
    raise PublishError(
        "output.save_directory",
        f"{target} already holds {not_ours(target)}, which compressflow did not publish (no "
        f"readable {MANIFEST})",
        "choose another save_directory, or empty that folder yourself; output.overwrite: true "
        "replaces only an earlier compressflow output, never other files",
    )


def _not_reused(target: Path, changed: list[str] | None) -> tuple[str, str]:
    """(problem, fix) of an output these inputs made that cannot be reused as it is."""
    if changed is None:
        return (
            f"{target} was published from these same inputs, but its manifest does not record "
            "the sha256 of each of its files (an earlier compressflow version's output, or an "
            "edited manifest): they cannot be checked, so it is not reused",
            "set output.overwrite: true to calibrate and publish it anew",
        )
    listed = "; ".join(changed[:3]) + ("; ..." if len(changed) > 3 else "")
    return (
        f"{target} was published from these same inputs, but it changed since ({listed}): not "
        "what its manifest says was verified, so it is not reused",
        "set output.overwrite: true to calibrate and publish it anew (only the files it "
        "published are replaced; move out any you added), or put the folder back as it was "
        "published",
    )


def refuse_unpublished(target: Path, manifest: Manifest) -> None:
    """Refuse to replace an earlier output of ours that holds anything it did not publish."""
    extra = not_published(target, manifest)
    if extra is None:
        raise PublishError(
            "output.save_directory",
            f"{target} holds an output of an earlier compressflow version, which did not record "
            "the files it published, so files added since cannot be told from its own",
            "check that folder holds nothing of yours and delete it yourself, or choose another "
            "save_directory",
        )
    if extra:
        raise PublishError(
            "output.save_directory",
            f"{target} holds {len(extra)} entries the earlier compressflow output did not "
            f"publish ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}); replacing it "
            "would delete them",
            "move them out of that folder, or choose another save_directory",
        )


def not_ours(target: Path) -> str:
    """What is at `target`, for a refusal: a file, or the first few names in the folder."""
    if not target.is_dir():
        return "a file"
    names = sorted(entry.name for entry in target.iterdir())
    return f"{len(names)} entries ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def relation(path: Path, other: Path) -> str | None:
    """How two resolved paths overlap: 'is', 'lies inside' or 'contains'; None when apart."""
    if path == other:
        return "is"
    if other in path.parents:
        return "lies inside"
    if path in other.parents:
        return "contains"
    return None


def source_folder(model_path: str | Path) -> Path:
    """Where a model's files live, symlinks resolved; for a hub snapshot its repository's whole
    cache folder (`models--org--name`), whose `blobs/` hold the files the snapshot links to."""
    path = Path(model_path).expanduser().resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent
    return path


def check_apart(target: Path, source: Path, offload: str = "") -> None:
    """Refuse an output that is, lies inside or contains the source model's folder, whatever
    `overwrite` says (publishing replaces the output folder), and a user's offload folder that is
    or lies inside either of them (offloaded weights would be written among theirs)."""
    target, source = target.expanduser().resolve(), source_folder(source)
    if how := relation(target, source):
        raise PublishError(
            "output.save_directory",
            f"{target} {how} the source model's folder {source} (symlinks resolved): "
            "publishing there could replace or delete the original weights",
            "choose a save_directory outside the source model's folder",
        )
    if not offload:
        return
    folder = Path(offload).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise InputError(
            "calibration.offload_folder",
            f"{folder} is a file, not a folder",
            "choose a folder, or leave offload_folder empty for a temporary folder beside the "
            "output",
        )
    for other, what in ((source, "the source model's folder"), (target, "the output folder")):
        if (how := relation(folder, other)) in ("is", "lies inside"):
            raise InputError(
                "calibration.offload_folder",
                f"{folder} {how} {what} {other} (symlinks resolved): offloaded weights would be "
                "written among its files",
                "choose an offload_folder outside both, or leave it empty for a temporary folder "
                "beside the output",
            )


def staging_path(target: Path) -> Path:
    """A fresh hidden folder beside `target` (same filesystem, so publishing is one rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent / _staging_name(target, os.getpid(), uuid.uuid4().hex[:8])


def _staging_name(target: Path, pid: int, tag: str) -> str:
    return f".{target.name}.staging-{pid}-{tag}"


PID_MAX = 4194304  # Linux's largest pid_max: the longest pid a leftover's name can carry


# File systems that hold no files of a user's, where a save cannot land (/proc, /sys, /dev's own).
PSEUDO_FILE_SYSTEMS = frozenset(
    "proc sysfs devtmpfs devpts cgroup cgroup2 debugfs tracefs securityfs pstore bpf configfs "
    "fusectl mqueue binfmt_misc efivarfs selinuxfs nsfs autofs hugetlbfs rpc_pipefs".split()
)


def file_system(path: Path) -> str | None:
    """The type of the file system `path` lies on, from Linux's mount table; None elsewhere."""
    try:
        table = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    where, best, kind = str(path.resolve()), "", None
    for line in table:
        mount, _, source = line.partition(" - ")
        point = mount.split(" ")[4].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best) and source:
            best, kind = point, source.split(" ")[0]
    return kind


def _nearest_existing(target: Path) -> tuple[Path, bool]:
    """The nearest of `target` and its parents that exists, and whether a path below it was too
    long even to look at (a name past NAME_MAX, or the whole past PATH_MAX)."""
    too_long = False
    for path in (target, *target.parents):
        try:
            if path.exists():
                return path, too_long
        except OSError as exc:  # exists() passes on ENAMETOOLONG and a folder it may not search
            if exc.errno != errno.ENAMETOOLONG:
                raise PublishError(
                    "output.save_directory",
                    f"{path} cannot be looked at by this worker ({exc.strerror})",
                    "choose a save_directory the user the worker runs as may reach",
                ) from None
            too_long = True
    return Path("/"), too_long


def check_output_path(target: Path) -> None:
    """Refuse, before any work, an output path a run could not create: one under a file, on a
    file system that holds no files (/proc, /sys), in a folder this worker may not write, a path
    or a name too long for the file system, or a name too long for the names a run gives its
    working files beside it (the longest is the reference logits')."""
    existing, too_long = _nearest_existing(target)
    if too_long:
        longest = max(len(os.fsencode(part)) for part in target.parts)
        raise PublishError(
            "output.save_directory",
            f"{str(target)[:60]}... is {len(os.fsencode(str(target))):,} bytes long, its longest "
            f"part {longest:,} bytes: past the {os.pathconf(existing, 'PC_PATH_MAX'):,} bytes a "
            f"path, or the {os.pathconf(existing, 'PC_NAME_MAX')} bytes a name, can have there",
            "choose a shorter save_directory",
        )
    if not existing.is_dir():
        raise PublishError(
            "output.save_directory",
            f"{target} {'is' if existing == target else 'lies under'} {existing}, which is a "
            "file, not a folder",
            "choose a save_directory that is a folder, or under one",
        )
    if (kind := file_system(existing)) in PSEUDO_FILE_SYSTEMS:
        raise PublishError(
            "output.save_directory",
            f"{target} lies on {existing}'s {kind} file system, which the kernel fills with its "
            "own entries: no model can be saved there",
            "choose a save_directory on a disk (or a mounted volume) for models",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PublishError(
            "output.save_directory",
            f"{target} {'is' if existing == target else 'lies under'} {existing}, which the user "
            f"this worker runs as (uid {os.getuid()}) may not write to, or which is mounted "
            "read-only",
            "choose a save_directory that user may write to, or make the folder writable for it",
        )
    name = len(os.fsencode(target.name))
    longest = reference_path(target.parent / _staging_name(target, PID_MAX, "f" * 8)).name
    added, limit = len(os.fsencode(longest)) - name, os.pathconf(existing, "PC_NAME_MAX")
    if name + added > limit:
        raise PublishError(
            "output.save_directory",
            f"its last part, {target.name[:40]}..., is {name} bytes long: the working files a "
            f"run keeps beside it add {added} bytes, past the {limit} bytes a file name can "
            "have there",
            f"choose a save_directory whose last part is at most {limit - added} bytes",
        )


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
