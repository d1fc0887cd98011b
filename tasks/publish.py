"""Publish: seals a calibrated checkpoint into `save_directory`, atomically, with its manifest.

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
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

from prefect import task
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from pydantic import BaseModel, Field

from flows.params import OutputArgs, RecipeArgs
from tasks import tracking
from tasks.build_dataset import BuiltDataset
from tasks.calibrate import Calibration
from tasks.disk_space import disk_full_is_clear
from tasks.errors import PublishError
from tasks.fetch_model import FetchedModel
from tasks.render_recipe import RenderedRecipe

MANIFEST = "manifest.json"
LIBRARIES = ("llmcompressor", "compressed-tensors", "transformers", "torch", "datasets", "prefect")


class StageRecord(BaseModel):
    name: str
    seconds: float
    cached: bool


class PublishedModel(BaseModel):
    """Where the compressed model is and what it is: what downstream flows consume."""

    path: str
    run_key: str
    reused: bool = Field(description="True when an earlier run's output was returned as is.")
    model_identity: str
    scheme: str | None
    size_bytes: int
    original_size_bytes: int
    compression_ratio: float
    stages: list[StageRecord] = Field(
        default_factory=list, description="This run's stages: seconds taken and cache hits."
    )
    tracking: str = Field(default="", description="Where ClearML logged the run, or why it failed.")


def library_versions() -> dict[str, str]:
    return {name: version(name) for name in LIBRARIES}


def run_key(
    model: FetchedModel,
    dataset: BuiltDataset | None,
    recipe: RenderedRecipe,
    recipe_args: RecipeArgs,
    output: OutputArgs,
) -> str:
    """Hash of everything that determines the compressed checkpoint."""
    parts = {
        "model": model.identity,
        "model_class": model.model_class,
        "dataset": dataset.fingerprint if dataset else None,
        "recipe": recipe.sha256,
        "pipeline": recipe_args.pipeline,
        "sequential_targets": recipe_args.sequential_targets,
        "tracing_ignore": recipe_args.tracing_ignore,
        "save_compressed": output.save_compressed,
        "libraries": library_versions(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def output_path(output: OutputArgs, model: FetchedModel, recipe: RenderedRecipe) -> Path:
    """`save_directory`, or <$COMPRESSFLOW_OUTPUT_DIR or ./outputs>/<model name>-<scheme>."""
    if output.save_directory:
        return Path(output.save_directory).expanduser().resolve()
    base = Path(os.environ.get("COMPRESSFLOW_OUTPUT_DIR", "outputs")).expanduser().resolve()
    name = re.sub(r"[^\w.-]+", "-", Path(model.model_id.rstrip("/")).name)
    return base / f"{name}-{recipe.scheme or 'compressed'}"


def read_manifest(path: Path) -> dict | None:
    """The manifest of a published folder; None when the folder holds no compressflow output."""
    try:
        return json.loads((path / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def published_model(path: Path, manifest: dict, reused: bool) -> PublishedModel:
    return PublishedModel(reused=reused, path=str(path), **manifest["result"])


def find_published(target: Path, key: str) -> PublishedModel | None:
    """The output already at `target` when it was made from exactly the same inputs."""
    manifest = read_manifest(target)
    if manifest and manifest.get("result", {}).get("run_key") == key:
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
        f"another compressflow output (model {manifest['result']['model_identity']}, "
        f"scheme {manifest['result']['scheme']})"
        if manifest
        else "files that compressflow did not publish"
    )
    raise PublishError(
        f"output.save_directory: {target} already holds {held}. Fix: choose another "
        "save_directory, or set output.overwrite: true to replace it"
    )


def staging_path(target: Path) -> Path:
    """A fresh hidden folder beside `target` (same filesystem, so publishing is one rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent / f".{target.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_stale_staging(target: Path) -> None:
    """Delete staging folders of `target` left by runs whose process is gone (e.g. SIGKILL)."""
    for folder in target.parent.glob(f".{target.name}.staging-*"):
        pid = int(folder.name.rsplit("-", 2)[-2])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
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
            f"output.save_directory: {target} was filled by another run while this one "
            "calibrated. Fix: rerun (it will reuse that output if it matches) or pick another folder"
        )
    retired = target.parent / f".{target.name}.retired-{uuid.uuid4().hex[:8]}"
    target.rename(retired)
    staging.rename(target)
    shutil.rmtree(retired, ignore_errors=True)


def summary_markdown(published: PublishedModel, manifest: dict) -> str:
    stages = "\n".join(
        f"| {s['name']} | {s['seconds']:.2f} | {'yes' if s['cached'] else 'no'} |"
        for s in manifest["stages"]
    )
    return (
        f"# Compressed model\n\n"
        f"- **Output**: `{published.path}`\n"
        f"- **Base model**: `{published.model_identity}`\n"
        f"- **Scheme**: {published.scheme}\n"
        f"- **Size**: {published.size_bytes / 1e6:.1f} MB "
        f"(original {published.original_size_bytes / 1e6:.1f} MB, "
        f"ratio {published.compression_ratio:.2f}x)\n"
        f"- **Run key**: `{published.run_key}`\n\n"
        f"| stage | seconds | cached |\n|---|---|---|\n{stages}\n"
    )


@task(name="publish", cache_policy=NO_CACHE)
def publish(
    calibration: Calibration,
    model: FetchedModel,
    dataset: BuiltDataset | None,
    recipe: RenderedRecipe,
    target: str,
    key: str,
    inputs: dict,
    output: OutputArgs,
    stages: list[dict],
) -> PublishedModel:
    """Write recipe.yaml and manifest.json beside the checkpoint, then publish it atomically."""
    staging, target_path = Path(calibration.staging_path), Path(target)
    result = {
        "run_key": key,
        "model_identity": model.identity,
        "scheme": recipe.scheme,
        "size_bytes": calibration.checkpoint_bytes,
        "original_size_bytes": model.size_bytes,
        "compression_ratio": round(model.size_bytes / max(calibration.checkpoint_bytes, 1), 3),
    }
    manifest = {
        "created_at": datetime.now(timezone.utc).isoformat(),
        "result": result,
        "inputs": inputs,
        "model": model.model_dump(exclude={"path"}),
        "dataset": dataset.model_dump(exclude={"path"}) if dataset else None,
        "recipe": recipe.model_dump(exclude={"yaml"}),
        "libraries": library_versions(),
        "stages": stages,
        "peak_rss_mb": calibration.peak_rss_mb,
        "peak_gpu_mb": calibration.peak_gpu_mb,
        "modules": [m.model_dump() for m in calibration.modules],
        "tags": output.tags,
    }
    with disk_full_is_clear(staging):
        (staging / "recipe.yaml").write_text(recipe.yaml)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        seal(staging, target_path, output.overwrite)
    published = published_model(target_path, manifest, reused=False)

    get_run_logger().info(
        "Published %s: %.1f MB (%.2fx smaller than %.1f MB)",
        target_path,
        published.size_bytes / 1e6,
        published.compression_ratio,
        published.original_size_bytes / 1e6,
    )
    create_markdown_artifact(summary_markdown(published, manifest), key="compressed-model-summary")
    if calibration.modules:
        create_table_artifact(
            [m.model_dump() for m in calibration.modules],
            key="per-module-errors",
            description="Quantization error and time per module, as llm-compressor reported them",
        )
    create_link_artifact(target_path.as_uri(), link_text=str(target_path), key="compressed-model")
    tracker = tracking.current()
    tracker.artifact("manifest", manifest)
    tracker.artifact("recipe", str(target_path / "recipe.yaml"))
    tracker.register_model(
        target_path,
        name=target_path.name,
        tags=output.tags,
        metadata={
            "base_model": model.identity,
            "recipe_sha256": recipe.sha256,
            "scheme": recipe.scheme,
            "compression_ratio": published.compression_ratio,
            "run_key": key,
        },
    )
    return published
