"""What ties a run to its model in the Prefect UI: run names, tags, assets and links between runs.

A person looking at the Runs page should see which model each run compressed and how, without
opening it: runs are named after the model and scheme, and carry `output.tags` and the scheme as
Prefect tags. The Assets page shows lineage: the base model and the calibration data feed the
compressed checkpoint (materialized by the publish stage), and the checkpoint feeds its
evaluation. The compression run and the evaluation it triggered link to each other.

Everything here is presentation: a failure to tag or link is logged and never fails a run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prefect.assets import Asset, AssetProperties, materialize

from compressflow.logs import run_logger
from compressflow.params import ModelArgs, RecipeArgs
from compressflow.reporting.artifacts import model_name
from compressflow.results import BuiltDataset, FetchedModel


def compress_run_name(model: Any, recipe: Any) -> str:
    """`Llama-3.2-1B-Instruct W4A16`: what the Runs page lists for a compression."""
    model, recipe = ModelArgs.model_validate(model), RecipeArgs.model_validate(recipe or {})
    return f"{model_name(model.model_id)} {recipe.label()}"


def current_parameters() -> dict[str, Any]:
    """The running flow's parameters (empty outside a run), for `flow_run_name` callables."""
    from prefect.runtime import flow_run

    return dict(flow_run.parameters or {})


def add_run_tags(tags: list[str]) -> None:
    """Add `tags` to the running flow run (a deployment's run gets only the deployment's tags)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    wanted = [tag for tag in dict.fromkeys(tags) if tag]
    if not flow_run.id or not wanted:
        return
    try:
        with get_client(sync_client=True) as client:
            current = client.read_flow_run(flow_run.id).tags
            client.update_flow_run(flow_run.id, tags=list(dict.fromkeys([*current, *wanted])))
    except Exception as exc:  # presentation only: the run goes on untagged
        run_logger(__name__).warning("Could not tag the flow run with %s: %s", wanted, exc)


# ---------------------------------------------------------------- assets


_NOT_IN_KEYS = re.compile(r"[\s#?&%\"'<>\[\]{}|\\^`]")


def _key(protocol: str, location: str) -> str:
    """An asset key Prefect accepts: `protocol://location`, its restricted characters as `_`."""
    return f"{protocol}://{_NOT_IN_KEYS.sub('_', location)}"[:512]


def _file_key(path: str | Path, protocol: str = "file") -> str:
    return _key(protocol, Path(path).expanduser().resolve().as_posix())


def _base_model_asset(model: FetchedModel) -> Asset:
    """The model compressed: the hub repository, the ClearML model or the local folder."""
    if model.source == "hub":
        key = _key("huggingface", model.model_id)
    elif model.source == "clearml":
        key = _key("clearml", f"models/{model.model_id}")
    else:
        key = _file_key(model.model_id)
    where = f" at {model.revision_resolved}" if model.revision_resolved else ""
    return Asset(
        key=key,
        properties=AssetProperties(
            name=model_name(model.model_id),
            description=f"Base model {model.model_id}{where}",
            url=f"https://huggingface.co/{model.model_id}" if model.source == "hub" else None,
        ),
    )


def _calibration_data_asset(dataset: BuiltDataset) -> Asset:
    """The tokenized calibration set, as built (cached by its fingerprint)."""
    return Asset(
        key=_file_key(dataset.path),
        properties=AssetProperties(
            name=f"calibration data ({dataset.source})",
            description=f"{dataset.num_samples} tokenized samples from {dataset.source}",
        ),
    )


def publish_lineage(
    model: FetchedModel, dataset: BuiltDataset | None, target: Path, label: str
) -> tuple[Asset, list[Asset]]:
    """The checkpoint publishing materializes, and what it is made from (data-free: no data)."""
    upstream = [_base_model_asset(model)]
    if dataset is not None:
        upstream.append(_calibration_data_asset(dataset))
    return checkpoint_asset(target, label), upstream


def checkpoint_asset(path: str | Path, label: str) -> Asset:
    """The published checkpoint; the evaluation depends on the same key."""
    return Asset(
        key=_file_key(path),
        properties=AssetProperties(name=f"{Path(path).name} ({label})", description=str(path)),
    )


def uploaded_asset(uri: str, label: str) -> Asset:
    """The published checkpoint in object storage (output.upload_uri), keyed by its URI: the
    upload stage materializes it from the local checkpoint, so the Assets page names the store."""
    return Asset(
        key=_key(uri.split("://", 1)[0], uri.split("://", 1)[1]),
        properties=AssetProperties(
            name=f"{uri.rstrip('/').rsplit('/', 1)[-1]} ({label})", description=uri
        ),
    )


def evaluation_asset(checkpoint: str | Path) -> Asset:
    return Asset(
        key=_file_key(checkpoint, protocol="evaluation"),
        properties=AssetProperties(
            name=f"evaluation of {Path(checkpoint).name}",
            description=f"Perplexity, KL divergence and top-1 agreement of {checkpoint} "
            "against its base model",
        ),
    )


def materializing(stage, asset: Asset, upstream: list[Asset], by: str):
    """`stage` as a task that materializes `asset` from `upstream` (the Assets page's lineage)."""
    return materialize(
        asset, by=by, asset_deps=upstream, name=stage.name, cache_policy=stage.cache_policy
    )(stage.fn)


# ---------------------------------------------------------------- links between runs


def run_url(flow_run_id: str) -> str | None:
    """The run's page in the Prefect UI; None when no UI URL is configured (a local run)."""
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id)


def link_runs(compress_run_id: str, key: str) -> None:
    """Link this (evaluation) run and the compression run that published its model, both ways."""
    from prefect.artifacts import create_link_artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.runtime import flow_run

    here, there = run_url(flow_run.id) if flow_run.id else None, run_url(compress_run_id)
    if not (here and there):
        return
    try:
        create_link_artifact(there, link_text="the compression run", key=f"{key}-compressed-by")
        with get_client(sync_client=True) as client:
            client.create_artifact(
                ArtifactCreate(
                    key=f"{key}-evaluated-by",
                    type="markdown",  # what create_link_artifact stores too
                    data=f"[its evaluation: {flow_run.name}]({here})",
                    description="The evaluate-model run this compression triggered.",
                    flow_run_id=compress_run_id,
                )
            )
    except Exception as exc:  # presentation only
        run_logger(__name__).warning("Could not link the runs: %s", exc)
