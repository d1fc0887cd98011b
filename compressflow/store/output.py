"""Output-path policy: where a run publishes, and what may already be there.

The output is `save_directory`, or a folder named after the model and scheme under the output
folder (`output_path`). Before any work a run refuses a path it could not create
(`check_output_path`), an output that overlaps a file or folder the run reads (`check_apart`: the
source model's folder, the data, the recipe file, the held-out text), and a folder that already
holds another model (`check_target`), unless it is an earlier compressflow
output (it holds our manifest) and `overwrite` is asked for. An output made from the same inputs
and still holding the bytes it was published with is reused (`find_published`), or, on a
worker without the local copy, the one uploaded to `upload_uri` (`find_uploaded`). An upload
URI that is, lies inside or contains the output folder or a source the run reads is refused
(`check_upload_apart`).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pydantic import ValidationError

from compressflow.errors import InputError, PublishError
from compressflow.logs import run_logger
from compressflow.params import OutputArgs
from compressflow.results import FetchedModel, PublishedModel, RenderedRecipe
from compressflow.settings import settings
from compressflow.store.manifest import (
    MANIFEST,
    Manifest,
    changed_files,
    not_ours,
    published_model,
    read_manifest,
    refuse_unpublished,
)
from compressflow.store.object_uri import ObjectLocation, parse_upload_uri
from compressflow.store.objects import URI_FIELD, check_published
from compressflow.store.staging import PID_MAX, reference_path, staging_name


def output_path(output: OutputArgs, model: FetchedModel, recipe: RenderedRecipe) -> Path:
    """`save_directory`, or <$COMPRESSFLOW_OUTPUT_DIR or ./outputs>/<model name>-<scheme>."""
    if output.save_directory:
        return Path(output.save_directory).expanduser().resolve()
    base = settings().output_dir.expanduser().resolve()
    name = re.sub(r"[^\w.-]+", "-", Path(model.model_id.rstrip("/")).name)
    return base / f"{name}-{recipe.scheme or 'compressed'}"


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


def holds_nothing(target: Path) -> bool:
    """Whether `target` is absent or an empty folder: no output of any run is there."""
    return not os.path.lexists(target) or (
        target.is_dir() and not target.is_symlink() and not any(target.iterdir())
    )


def find_uploaded(output: OutputArgs, key: str) -> tuple[PublishedModel, Manifest] | None:
    """The output at `output.upload_uri` when it was made from exactly the same inputs, verified,
    and every object there is still what its manifest recorded on upload (one listing and one
    manifest read: `compressflow.store.objects.check_published`); None otherwise. Nothing is
    downloaded: the PublishedModel's `path` is the URI, which is where the model is."""
    body, why = check_published(output.upload_uri, output.upload_credentials)
    if body is None:
        run_logger(__name__).info("Nothing to reuse at %s: %s", output.upload_uri, why)
        return None
    try:
        manifest = Manifest.model_validate(body)
    except ValidationError:  # a manifest of ours this version cannot read: not reused
        return None
    if not _same_run(manifest, key):
        return None
    uri = output.upload_uri
    published = PublishedModel(
        reused=True, path=uri, upload_uri=uri, **manifest.result.model_dump()
    )
    return published, manifest


def _as_location(place: str | Path) -> ObjectLocation | None:
    """Where a source or output lies, as a store location: a local path as file://, a URI as
    itself (leniently: a source's URI is checked by its own field); None for neither."""
    text = str(place)
    if "://" not in text:
        return ObjectLocation("file", "", str(source_folder(text)))
    parts = urlsplit(text)
    scheme, path = parts.scheme.lower(), unquote(parts.path).strip("/")
    if scheme == "file":
        return ObjectLocation("file", "", str(Path("/", path).resolve()))
    return ObjectLocation(scheme, parts.netloc.lower(), path)


def _uri_relation(upload: ObjectLocation, other: ObjectLocation) -> str | None:
    if (upload.scheme, upload.bucket) != (other.scheme, other.bucket):
        return None
    if upload.scheme == "file":  # symlinks resolved, as check_apart compares folders
        return relation(Path(upload.prefix).resolve(), Path(other.prefix))
    mine, theirs = upload.prefix.split("/"), [p for p in other.prefix.split("/") if p]
    if mine == theirs:
        return "is"
    if mine[: len(theirs)] == theirs:
        return "lies inside"
    if theirs[: len(mine)] == mine:
        return "contains"
    return None


def check_upload_apart(uri: str, places: list[tuple[str, str | Path]]) -> None:
    """Refuse an upload URI that is, lies inside or contains one of `places`, each (what it is,
    its folder or URI): the output folder (an upload into itself) or a source the run reads (an
    upload would write among its files, and `overwrite` delete some)."""
    upload = parse_upload_uri(uri, URI_FIELD)
    for what, place in places:
        other = _as_location(place)
        if other is not None and (how := _uri_relation(upload, other)):
            raise InputError(
                URI_FIELD,
                f"{upload.uri} {how} {what}, {place} (symlinks resolved): uploading there would "
                "write among its files",
                "choose an upload_uri apart from the model, the data and save_directory",
            )


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


def check_apart(
    target: Path,
    sources: list[tuple[str, str | Path]],
    offload: str = "",
    field: str = "output.save_directory",
) -> None:
    """Refuse an output that is, lies inside or contains a file or folder the run reads, whatever
    `overwrite` says: `sources`, each (what it is, with the parameter naming it; its path), the
    source model's folder, the calibration data, the recipe file, the held-out text. Publishing
    replaces the output folder, and model files left among an input are what the next run reads
    as that input. Also refused: a user's offload folder that is or lies inside one of them or
    the output (offloaded weights would be written among their files)."""
    named, target = Path(os.path.abspath(target.expanduser())), target.expanduser().resolve()
    for what, place in sources:
        # Symlinks resolved, and as named: a link to an input inside the output counts too.
        path, given = source_folder(place), Path(os.path.abspath(Path(place).expanduser()))
        for output, source, seen in (
            (target, path, "symlinks resolved"),
            (named, given, "as named"),
        ):
            if how := relation(output, source):
                raise PublishError(
                    field,
                    f"{output} {how} {what}: {source} ({seen}): publishing there could replace "
                    "or delete what the run reads, or leave model files where a later run reads "
                    "this input",
                    f"choose a {field.rsplit('.', 1)[-1]} outside {source} that does not hold it "
                    "either, e.g. a folder beside it",
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
    for what, other in [*sources, ("the output folder", target)]:
        other = source_folder(other)
        if (how := relation(folder, other)) in ("is", "lies inside"):
            raise InputError(
                "calibration.offload_folder",
                f"{folder} {how} {what} {other} (symlinks resolved): offloaded weights would be "
                "written among its files",
                "choose an offload_folder apart from the inputs and the output, or leave it "
                "empty for a temporary folder beside the output",
            )


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
    longest = reference_path(target.parent / staging_name(target, PID_MAX, "f" * 8)).name
    added, limit = len(os.fsencode(longest)) - name, os.pathconf(existing, "PC_NAME_MAX")
    if name + added > limit:
        raise PublishError(
            "output.save_directory",
            f"its last part, {target.name[:40]}..., is {name} bytes long: the working files a "
            f"run keeps beside it add {added} bytes, past the {limit} bytes a file name can "
            "have there",
            f"choose a save_directory whose last part is at most {limit - added} bytes",
        )
