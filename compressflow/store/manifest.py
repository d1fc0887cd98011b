"""The manifest of a published model: its schema, reading and writing it, and whether a published
folder still holds what its manifest lists.

A published folder holds the checkpoint, the rendered `recipe.yaml`, the model card and a
`manifest.json`. The manifest's `run_key` (`compressflow.store.identity.run_key`) hashes what
determines the result: a later run with the same key finds the published folder and returns it
without calibrating again (`compressflow.store.output.find_published`), as long as the folder
still holds the bytes the manifest lists. Where an output goes is `compressflow.store.output`'s
business; how it is staged and sealed, `compressflow.store.staging`'s.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator

from compressflow.errors import PublishError
from compressflow.inputs import Inputs
from compressflow.limits import MAX_JSON_BYTES, not_regular
from compressflow.params import DatasetArgs, ModelArgs
from compressflow.results import (
    Calibration,
    EvaluationReport,
    LayerTime,
    MemoryPlan,
    ModuleMetric,
    PublishedModel,
    StageRecord,
    TargetSearch,
    Verification,
)
from compressflow.store.atomic import write_atomic
from compressflow.store.identity import file_digests, library_versions

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

    @classmethod
    def of_run(
        cls,
        inputs: Inputs,
        calibration: Calibration,
        plan: MemoryPlan,
        verification: Verification,
        stages: list[StageRecord],
        search: TargetSearch | None,
    ) -> Manifest:
        """The manifest of a run about to publish what `calibration` staged, less the files it
        publishes (known once the staging folder is complete). `inputs.recipe` is the recipe
        `calibration` ran (a target search's chosen round); `search`: what compressing to a
        quality target tried."""
        model, dataset, recipe = inputs.model, inputs.dataset, inputs.recipe
        return cls(
            created_at=datetime.now(timezone.utc).isoformat(),
            result=ManifestResult(
                run_key=inputs.key,
                model_identity=model.identity,
                scheme=recipe.scheme,
                size_bytes=calibration.checkpoint_bytes,
                original_size_bytes=model.size_bytes,
                compression_ratio=round(model.size_bytes / max(calibration.checkpoint_bytes, 1), 3),
            ),
            inputs=inputs.args.recorded(),
            model=model.model_dump(exclude={"path"}),
            dataset=dataset.model_dump(exclude={"path"}) if dataset else None,
            recipe=recipe.model_dump(exclude={"yaml"}),
            libraries=library_versions(),
            stages=stages,
            # The calibration's figures lie flat, under the names manifests already published
            # carry (reuse checks read those back); its staging and reference paths are the
            # run's own, never published.
            calibration_seconds=round(calibration.seconds, 3),
            resumed_from=calibration.resumed_from,
            reference_seconds=calibration.reference_seconds,
            peak_rss_mb=calibration.peak_rss_mb,
            peak_gpu_mb=calibration.peak_gpu_mb,
            modules=calibration.modules,
            layers=calibration.layers,
            tags=inputs.args.output.tags,
            verification=verification,
            memory_plan=plan,
            target=search,
        )

    def base_model_args(self) -> ModelArgs | None:
        """The ModelArgs the compressed model was made from."""
        model = self.inputs.get("model")
        return ModelArgs(**model) if model else None

    def calibration_args(self) -> DatasetArgs | None:
        """The calibration DatasetArgs, or None when the recipe used no data (e.g. FP8_DYNAMIC)."""
        return DatasetArgs(**self.inputs["dataset"]) if self.dataset else None


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
