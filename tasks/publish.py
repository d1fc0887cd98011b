"""Publish: writes recipe.yaml, manifest.json and the model card (README.md) beside the calibrated checkpoint and seals it.

How a folder is sealed (one rename from staging) and what the manifest holds is the output
store's business (`compressflow.store.staging`, `compressflow.store.manifest`); this stage
assembles the manifest, seals, and shows the result: a Prefect summary artifact and the ClearML
model (`compressflow.reporting.summary`). With `output.upload_uri` those two wait for the upload
stage (tasks/upload.py), so they name the store's URI.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.errors import InputError
from compressflow.inputs import Inputs
from compressflow.logs import run_logger
from compressflow.reporting import tracking
from compressflow.reporting.model_card import CARD, model_card
from compressflow.reporting.summary import create_summary, register_published
from compressflow.reporting.tradeoff import SVG_FILE, tradeoff_svg
from compressflow.results import (
    Calibration,
    FetchedModel,
    MemoryPlan,
    PublishedModel,
    StageRecord,
    TargetSearch,
    Verification,
)
from compressflow.store.disk_space import disk_full_is_clear
from compressflow.store.identity import changed_since, file_digests
from compressflow.store.manifest import (
    MANIFEST,
    Manifest,
    hashed_files,
    published_files,
    published_model,
    write_manifest,
)
from compressflow.store.staging import seal


def check_source_unchanged(model: FetchedModel) -> None:
    """Refuse to publish from a source folder written while the run read it (a new checkpoint
    copied over the old, shard by shard): the weights calibrated may mix two versions, and the
    manifest would name the one fetched."""
    changed = changed_since(Path(model.path), model.files)
    if changed:
        more = ", ..." if len(changed) > 3 else ""
        raise InputError(
            "model.model_id",
            f"{model.path} changed while this run read it ({', '.join(changed[:3])}{more} "
            "written, replaced or removed since it was fetched): what was calibrated may mix two "
            "versions of the model; nothing was published",
            "rerun once nothing writes into that folder; to update a model in place, copy the "
            "new one beside it and rename it into place, or give each version a folder of its own",
        )


@task(name="publish", cache_policy=NO_CACHE)
def publish(
    inputs: Inputs,
    calibration: Calibration,
    plan: MemoryPlan,
    verification: Verification,
    stages: list[StageRecord],
    search: TargetSearch | None = None,
) -> PublishedModel:
    """Write recipe.yaml and manifest.json beside the checkpoint, then publish it atomically.

    `inputs.recipe` is the recipe `calibration` ran (a target search's chosen round);
    `search`: what compressing to a quality target tried, when the run had a target."""
    started = time.perf_counter()
    model, recipe, output = inputs.model, inputs.recipe, inputs.args.output
    staging, target_path = Path(calibration.staging_path), inputs.target
    manifest = Manifest.of_run(inputs, calibration, plan, verification, stages, search)
    check_source_unchanged(model)
    with disk_full_is_clear(staging):
        (staging / "recipe.yaml").write_text(recipe.yaml)
        if search is not None and search.mix is not None:  # the card's chart, beside it
            (staging / SVG_FILE).write_text(tradeoff_svg(search.mix.points))
        manifest.files = published_files(staging, MANIFEST, CARD)
        manifest.file_sha256 = file_digests(staging, hashed_files(staging))
        write_manifest(staging, manifest)
        link = tracking.current().link()
        card = model_card(manifest, target_path, Path(model.path), link, output.upload_uri)
        (staging / CARD).write_text(card)
        seal(staging, target_path, output.overwrite)
    published = published_model(target_path, manifest, reused=False)

    run_logger(__name__).info(
        "Published %s: %.1f MB (%.2fx smaller than %.1f MB)",
        target_path,
        published.size_bytes / 1e6,
        published.compression_ratio,
        published.original_size_bytes / 1e6,
    )
    tracker = tracking.current()
    tracker.artifact("manifest", manifest.model_dump(mode="json"))
    tracker.artifact("recipe", str(target_path / "recipe.yaml"))
    tracker.artifact("model card", str(target_path / CARD))
    if output.upload_uri:  # the upload stage registers and summarizes it, naming the store
        return published
    register_published(published, manifest, output.tags)
    # Last, so publish's own row covers the sealing and the ClearML upload before it.
    publishing = StageRecord(
        name="publish", seconds=round(time.perf_counter() - started, 3), cached=False
    )
    create_summary(published, manifest, [*stages, publishing])
    return published
