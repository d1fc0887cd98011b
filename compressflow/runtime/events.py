"""The `compressflow.model.published` event: how other flows learn that a model is ready.

compress-model emits it once its output is at `save_directory`. Automations match it like any
Prefect event: the evaluate-model deployment's trigger in prefect.yaml fills its parameters from
the payload, and a user's own deployment can subscribe with the same `expect`/`match` lines.

- resource: `compressflow.model.<run_key>` (the run key names the checkpoint, not the run), with
  labels `compressflow.scheme`, `compressflow.reused` and `compressflow.auto_evaluate` (false when
  the caller evaluates the model itself, e.g. a sweep) so triggers can filter on them;
- related: the flow run that published it;
- payload: `path`, `model_identity`, `scheme`, `base_model` (the compress run's ModelArgs, so a
  consumer fetches the base model exactly as compression did), `run_key`, `reused`,
  `compression_ratio`, `flow_run_id`, and `upload_uri`: where the model was uploaded
  (`output.upload_uri`, complete and checked; "" when the run uploaded nothing). A consumer on
  another host reads the model from there: `path` is a folder on the publishing worker, or the
  same URI when that worker reused the upload without a local copy.

A reused output emits the event too, with `reused: "true"`: the model is published either way and
subscribers that only want new checkpoints filter on the label (evaluate-model's trigger does).
"""

from __future__ import annotations

from prefect import runtime
from prefect.events import emit_event
from prefect.events.schemas.events import Event

from compressflow.params import ModelArgs
from compressflow.results import PublishedModel

PUBLISHED = "compressflow.model.published"


def published_payload(published: PublishedModel, base: ModelArgs, flow_run_id: str | None) -> dict:
    return {
        "path": published.path,
        "model_identity": published.model_identity,
        "scheme": published.scheme,
        "base_model": base.model_dump(),
        "run_key": published.run_key,
        "reused": published.reused,
        "compression_ratio": published.compression_ratio,
        "flow_run_id": flow_run_id,
        "upload_uri": published.upload_uri,
    }


def emit_published(
    published: PublishedModel, base: ModelArgs, auto_evaluate: bool = True
) -> Event | None:
    """Emit `compressflow.model.published` for `published`, compressed from `base`."""
    flow_run_id = runtime.flow_run.id
    related = (
        [
            {
                "prefect.resource.id": f"prefect.flow-run.{flow_run_id}",
                "prefect.resource.role": "flow-run",
            }
        ]
        if flow_run_id
        else []
    )
    return emit_event(
        PUBLISHED,
        resource={
            "prefect.resource.id": f"compressflow.model.{published.run_key}",
            "prefect.resource.name": published.path,
            "compressflow.scheme": published.scheme or "custom",
            "compressflow.reused": str(published.reused).lower(),
            "compressflow.auto_evaluate": str(auto_evaluate).lower(),
        },
        related=related,
        payload=published_payload(published, base, flow_run_id),
    )
