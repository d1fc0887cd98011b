"""The on-disk contract of a published model: where it goes, its manifest, and how it is sealed.

A published folder holds the checkpoint, the rendered `recipe.yaml` and a `manifest.json`. It
appears in one `rename` from a staging folder beside it, so a reader never sees a partial model
and a failed or killed run leaves nothing at the output path. A folder that already holds another
model is never replaced unless `overwrite` is asked for.

The manifest's `run_key` hashes what determines the result (model identity, dataset fingerprint,
rendered recipe, calibration knobs, library versions): a later run with the same key finds the
published folder and returns it without calibrating again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from compressflow.errors import PublishError
from compressflow.params import CalibrationArgs, DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from compressflow.results import (
    BuiltDataset,
    FetchedModel,
    LayerTime,
    MemoryPlan,
    ModuleMetric,
    PublishedModel,
    RenderedRecipe,
    StageRecord,
    Verification,
)
from compressflow.settings import settings

MANIFEST = "manifest.json"


LIBRARIES = ("llmcompressor", "compressed-tensors", "transformers", "torch", "datasets", "prefect")


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
    reference_seconds: float | None = Field(
        default=None, description="Capturing the base model's logits for verification."
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

    def base_model_args(self) -> ModelArgs | None:
        """The ModelArgs the compressed model was made from."""
        model = self.inputs.get("model")
        return ModelArgs(**model) if model else None

    def calibration_args(self) -> DatasetArgs | None:
        """The calibration DatasetArgs, or None when the recipe used no data (e.g. FP8_DYNAMIC)."""
        return DatasetArgs(**self.inputs["dataset"]) if self.dataset else None


def library_versions() -> dict[str, str]:
    return {name: version(name) for name in LIBRARIES}


def run_key(
    model: FetchedModel,
    dataset: BuiltDataset | None,
    recipe: RenderedRecipe,
    recipe_args: RecipeArgs,
    output: OutputArgs,
    calibration: CalibrationArgs,
) -> str:
    """Hash of everything that determines the compressed checkpoint.

    Of the calibration knobs, the path and the batch size change the result (model_free rounds
    weights without oneshot; batches truncate to their shortest sample); where weights live and
    prefetching do not.
    """
    parts = {
        "model": model.identity,
        "model_class": model.model_class,
        "dataset": dataset.fingerprint if dataset else None,
        "recipe": recipe.sha256,
        "pipeline": recipe_args.pipeline,
        "sequential_targets": recipe_args.sequential_targets,
        "tracing_ignore": recipe_args.tracing_ignore,
        "save_compressed": output.save_compressed,
        "calibration": calibration.model_dump(
            include={"path", "batch_size", "moe_calibrate_all_experts"}
        ),
        "libraries": library_versions(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def output_path(output: OutputArgs, model: FetchedModel, recipe: RenderedRecipe) -> Path:
    """`save_directory`, or <$COMPRESSFLOW_OUTPUT_DIR or ./outputs>/<model name>-<scheme>."""
    if output.save_directory:
        return Path(output.save_directory).expanduser().resolve()
    base = settings().output_dir.expanduser().resolve()
    name = re.sub(r"[^\w.-]+", "-", Path(model.model_id.rstrip("/")).name)
    return base / f"{name}-{recipe.scheme or 'compressed'}"


def read_manifest(path: Path) -> Manifest | None:
    """The manifest of a published folder; None when the folder holds no compressflow output
    (no manifest, or one this version cannot read)."""
    try:
        return Manifest.model_validate_json((path / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, ValidationError):
        return None


def write_manifest(folder: Path, manifest: Manifest) -> None:
    (folder / MANIFEST).write_text(manifest.model_dump_json(indent=2))


def published_model(path: Path, manifest: Manifest, reused: bool) -> PublishedModel:
    return PublishedModel(reused=reused, path=str(path), **manifest.result.model_dump())


def find_published(target: Path, key: str) -> PublishedModel | None:
    """The output already at `target` when it was made from exactly the same inputs."""
    manifest = read_manifest(target)
    verified = manifest and manifest.verification and manifest.verification.passed
    if verified and manifest.result.run_key == key:
        return published_model(target, manifest, reused=True)
    return None


def check_target(target: Path, key: str, overwrite: bool) -> None:
    """Refuse, before any calibration, to replace a folder that holds something else."""
    if not target.exists() or find_published(target, key) or overwrite:
        return
    if target.is_dir() and not any(target.iterdir()):
        return
    manifest = read_manifest(target)
    held = (
        f"another compressflow output (model {manifest.result.model_identity}, "
        f"scheme {manifest.result.scheme})"
        if manifest
        else "files that compressflow did not publish"
    )
    raise PublishError(
        "output.save_directory",
        f"{target} already holds {held}",
        "choose another save_directory, or set output.overwrite: true to replace it",
    )


def staging_path(target: Path) -> Path:
    """A fresh hidden folder beside `target` (same filesystem, so publishing is one rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent / f".{target.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def reference_path(staging: Path) -> Path:
    """The base model's reference logits: beside the staging folder, never published."""
    return staging.with_name(staging.name + ".reference.pt")


def remove_stale_staging(target: Path) -> None:
    """Delete staging folders (and reference files) of `target` left by runs whose process is
    gone (e.g. SIGKILL)."""
    for leftover in target.parent.glob(f".{target.name}.staging-*"):
        pid = int(leftover.name.rsplit("-", 2)[-2])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        except PermissionError:  # alive, owned by someone else
            continue


def _fsync_tree(folder: Path) -> None:
    # Without this a power loss after the rename can publish a folder of empty files.
    for file in folder.rglob("*"):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())


def seal(staging: Path, target: Path, overwrite: bool) -> None:
    """Move `staging` to `target` in one rename; with overwrite, swap the old folder out first."""
    _fsync_tree(staging)
    if not target.exists():
        staging.rename(target)
        return
    if not overwrite and any(target.iterdir()):
        raise PublishError(
            "output.save_directory",
            f"{target} was filled by another run while this one calibrated",
            "rerun (it will reuse that output if it matches) or pick another folder",
        )
    retired = target.parent / f".{target.name}.retired-{uuid.uuid4().hex[:8]}"
    target.rename(retired)
    staging.rename(target)
    shutil.rmtree(retired, ignore_errors=True)
