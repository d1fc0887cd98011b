"""Publish: writes recipe.yaml and manifest.json beside the calibrated checkpoint and seals it.

How a folder is sealed (one rename from staging) and what the manifest holds is the output
store's business (`compressflow.manifest`); this stage assembles the manifest, seals, and shows
the result: Prefect artifacts and the ClearML model.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from prefect import task
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.cache_policies import NO_CACHE

from compressflow import tracking
from compressflow.disk_space import disk_full_is_clear
from compressflow.logs import run_logger
from compressflow.manifest import (
    Manifest,
    ManifestResult,
    library_versions,
    published_model,
    seal,
    write_manifest,
)
from compressflow.params import OutputArgs
from compressflow.results import (
    BuiltDataset,
    Calibration,
    FetchedModel,
    MemoryPlan,
    PublishedModel,
    RenderedRecipe,
    StageRecord,
    Verification,
)


def verified(manifest: Manifest) -> str:
    check = manifest.verification
    if check is None:
        return "no"
    figures = (
        f" (logits cosine {check.cosine:.4f}, KL {check.kl_divergence:.4f}, "
        f"top-1 {check.top1_agreement:.1%})"
        if check.cosine is not None
        else ""
    )
    return f"{'yes' if check.passed else 'NO'}: {len(check.checks)} checks{figures}"


def summary_markdown(published: PublishedModel, manifest: Manifest) -> str:
    stages = "\n".join(
        f"| {s.name} | {s.seconds:.2f} | {'yes' if s.cached else 'no'} |" for s in manifest.stages
    )
    return (
        f"# Compressed model\n\n"
        f"- **Output**: `{published.path}`\n"
        f"- **Base model**: `{published.model_identity}`\n"
        f"- **Scheme**: {published.scheme}\n"
        f"- **Size**: {published.size_bytes / 1e6:.1f} MB "
        f"(original {published.original_size_bytes / 1e6:.1f} MB, "
        f"ratio {published.compression_ratio:.2f}x)\n"
        f"- **Run key**: `{published.run_key}`\n"
        f"- **Verified**: {verified(manifest)}\n\n"
        f"| stage | seconds | cached |\n|---|---|---|\n{stages}\n"
    )


@task(name="publish", cache_policy=NO_CACHE)
def publish(
    calibration: Calibration,
    plan: MemoryPlan,
    verification: Verification,
    model: FetchedModel,
    dataset: BuiltDataset | None,
    recipe: RenderedRecipe,
    target: str,
    key: str,
    inputs: dict,
    output: OutputArgs,
    stages: list[StageRecord],
) -> PublishedModel:
    """Write recipe.yaml and manifest.json beside the checkpoint, then publish it atomically."""
    staging, target_path = Path(calibration.staging_path), Path(target)
    manifest = Manifest(
        created_at=datetime.now(timezone.utc).isoformat(),
        result=ManifestResult(
            run_key=key,
            model_identity=model.identity,
            scheme=recipe.scheme,
            size_bytes=calibration.checkpoint_bytes,
            original_size_bytes=model.size_bytes,
            compression_ratio=round(model.size_bytes / max(calibration.checkpoint_bytes, 1), 3),
        ),
        inputs=inputs,
        model=model.model_dump(exclude={"path"}),
        dataset=dataset.model_dump(exclude={"path"}) if dataset else None,
        recipe=recipe.model_dump(exclude={"yaml"}),
        libraries=library_versions(),
        stages=stages,
        calibration_seconds=round(calibration.seconds, 3),
        reference_seconds=calibration.reference_seconds,
        peak_rss_mb=calibration.peak_rss_mb,
        peak_gpu_mb=calibration.peak_gpu_mb,
        modules=calibration.modules,
        tags=output.tags,
        verification=verification,
        memory_plan=plan,
    )
    with disk_full_is_clear(staging):
        (staging / "recipe.yaml").write_text(recipe.yaml)
        write_manifest(staging, manifest)
        seal(staging, target_path, output.overwrite)
    published = published_model(target_path, manifest, reused=False)

    run_logger(__name__).info(
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
    tracker.artifact("manifest", manifest.model_dump(mode="json"))
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
