"""What a person reads after a compress run: the Prefect summary artifact and the ClearML model.

Both come last, once the model is where it stays: after publish when the run uploads nothing,
after the upload stage when it does (`output.upload_uri`), so they name the store's URI, not a
folder on a worker that another host cannot open. A run that reuses an output published earlier
shows the same summary, marked reused (`summarize_reused`), from the local folder or, on a
worker without one, from the manifest in the store.
"""

from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from compressflow.reporting import tracking
from compressflow.reporting.artifacts import (
    artifact_key,
    duration,
    layer_error_table,
    stage_table,
)
from compressflow.reporting.model_card import card_body
from compressflow.results import PublishedModel, StageRecord
from compressflow.store.manifest import Manifest, read_manifest


def summary_key(manifest: Manifest) -> str:
    return artifact_key(manifest.model["model_id"], manifest.recipe["source"], "summary")


def summary_markdown(
    published: PublishedModel,
    manifest: Manifest,
    stages: list[StageRecord],
    tracking_link: str | None,
) -> str:
    """What a person reads after the run: the model card's body, then this run's stages and
    GPTQ's per-module figures; `stages` are this run's, which a reused output's manifest does
    not hold."""
    reused = (
        f"> **Reused**: published earlier by another run, at {manifest.created_at}; this run "
        "found it made from the same inputs and did not calibrate.\n\n"
        if published.reused
        else ""
    )
    layers = (
        f"\n## Quantization error per module\n\n{layer_error_table(manifest.modules)}\n"
        if manifest.modules
        else ""
    )
    if manifest.layers:
        slowest = max(manifest.layers, key=lambda layer: layer.seconds)
        layers += (
            f"\n## Calibration time per layer\n\n{len(manifest.layers)} subgraph(s); the "
            f"slowest: layer {slowest.layer} (pass {slowest.calibration_pass}), "
            f"{duration(slowest.seconds)}. All of them are in `manifest.json` (`layers`) and "
            "ClearML (`calibration seconds by subgraph`).\n"
        )
    card = card_body(
        manifest,
        published.path,
        tracking_link,
        show_output=True,
        upload_uri=published.upload_uri,
    )
    return f"{reused}{card}\n## Stages\n\n{stage_table(stages)}\n{layers}"


def create_summary(
    published: PublishedModel, manifest: Manifest, stages: list[StageRecord]
) -> None:
    where = published.upload_uri or published.path
    create_markdown_artifact(
        summary_markdown(published, manifest, stages, tracking.current().link()),
        key=summary_key(manifest),
        description=f"Compressed model at {where}",
    )


def summarize_reused(published: PublishedModel, manifest: Manifest | None = None) -> None:
    """The summary for an output an earlier run published, which this run returns as is.

    Called by the flow under the output's lock, after find_published read the same manifest
    (or find_uploaded read it from the store: then it is passed in, there being no folder)."""
    manifest = manifest or read_manifest(Path(published.path))
    create_summary(published, manifest, published.stages)


def register_published(published: PublishedModel, manifest: Manifest, tags: list[str]) -> None:
    """The ClearML OutputModel of a newly published model: at its upload URI when it was
    uploaded (registered, not uploaded again), else the local folder."""
    folder = Path(published.path)
    tracking.current().register_model(
        folder,
        name=folder.name,
        tags=tags,
        metadata={
            "base_model": manifest.result.model_identity,
            "recipe_sha256": manifest.recipe.get("sha256"),
            "scheme": manifest.result.scheme,
            "compression_ratio": manifest.result.compression_ratio,
            "run_key": manifest.result.run_key,
        },
        uri=published.upload_uri,
    )
