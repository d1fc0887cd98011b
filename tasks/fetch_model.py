"""Fetch model: resolves `model_id` to a local folder and records an immutable identity.

Four sources: a local folder (identity: a content hash of its files), the Hugging Face hub (a
snapshot at a revision; identity: the resolved commit sha), the ClearML model registry
(identity: the ClearML model id and content hash), and a prefix in object storage (s3:// or
file://, downloaded once into the worker's cache, then a local folder: its content hash); the
downloads live in `compressflow/model/download.py` and `compressflow/store/sources.py`. The hub
token comes from a Prefect Secret block or HF_TOKEN, never from a flow parameter.

The folder's checks, run before weights load, live in `compressflow/model/folder_checks/`.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from compressflow.data.tokenizer import check_tokenizer
from compressflow.errors import ModelFetchError
from compressflow.logs import run_logger
from compressflow.model.args import is_store_uri
from compressflow.model.download import fetch_from_clearml, fetch_from_hub
from compressflow.model.folder_checks.files import local_folder
from compressflow.model.folder_checks.registry import check_folder
from compressflow.model.folder_checks.weights import check_has_weights
from compressflow.model.headers import parameter_count
from compressflow.model.loading import interpreted_class
from compressflow.params import ModelArgs
from compressflow.reporting import tracking
from compressflow.results import FetchedModel
from compressflow.runtime.isolation import in_child
from compressflow.store.caching import CACHE_EXPIRATION, LocalSourceAware
from compressflow.store.disk_space import folder_size
from compressflow.store.identity import content_hash, file_stats
from compressflow.store.sources import fetch_store


def hub_token(block_name: str) -> str | None:
    """The hub token from a Secret block, else None: huggingface_hub then reads HF_TOKEN itself."""
    if not block_name:
        return None
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL

    try:
        return Secret.load(block_name).get()
    except ValueError:
        # `from None`: Prefect's chained ValueError/ObjectNotFound/HTTP tracebacks bury the fix.
        raise ModelFetchError(
            "model.hub_token_block",
            f"no Secret block named {block_name!r} on "
            f"{PREFECT_API_URL.value() or 'the temporary local Prefect server (no PREFECT_API_URL)'}",
            "create it (`HF_TOKEN=hf_... python -m compressflow.blocks.register` saves "
            "'hf-token'; any name: UI > Blocks > + > Secret), or leave hub_token_block out to "
            "use the worker's HF_TOKEN",
        ) from None


def from_clearml(args: ModelArgs) -> Path:
    """A ClearML registry model's folder, connected to the run's task as its input model."""
    folder, input_model = fetch_from_clearml(args)
    tracking.current().connect_input_model(input_model)
    return folder


def is_transient(task, task_run, state) -> bool:
    """Retry network hiccups, never mistakes: a wrong id fails the same way every time."""
    from huggingface_hub.errors import HfHubHTTPError

    exc = state.result(raise_on_failure=False)
    if isinstance(exc, ModelFetchError):
        return False
    if isinstance(exc, HfHubHTTPError):
        response = getattr(exc, "response", None)
        return response is None or response.status_code >= 500 or response.status_code == 429
    return isinstance(exc, (ConnectionError, TimeoutError, OSError))


def fetch(args: ModelArgs, weights: bool = True) -> FetchedModel:
    """Resolve `args` to a local folder; the logic behind the `fetch model` task.

    With `weights=False` (validation) a hub or store model is fetched without its weight files.
    """
    revision_resolved = None
    if args.clearml_model:
        source, path = "clearml", from_clearml(args)
    elif is_store_uri(args.model_id):  # refused before a byte moves: URI, bucket, credentials
        source = "store"
        path = fetch_store(args.model_id, args.storage_credentials, weights=weights).path
    elif (local := local_folder(args)) is not None:  # refuses a path that does not exist
        source, path = "local", local
    else:
        source = "hub"
        # A missing token block fails here, before any download.
        path, revision_resolved = fetch_from_hub(args, hub_token(args.hub_token_block), weights)
    # Every source: a local folder has passed them once already, before any child started
    # (flows/checks.py `precheck`); a download is first checked here, once it is on disk.
    check_folder(path, args, weights or source not in ("hub", "store"))
    # What transformers raises building the model class from config.json, then the tokenizer
    # (which reads config.json too), is their files' fault: said now, before the dataset is
    # built, and for a data-free recipe (which builds none) before calibration.
    model_class = in_child(interpreted_class, path, args)
    in_child(check_tokenizer, path, args.trust_remote_code)
    files = file_stats(path)  # before hashing: a write from here on shows at publishing
    if source == "hub":
        identity = f"hub:{args.model_id}@{revision_resolved}"
    elif source == "clearml":
        identity = f"clearml:{args.model_id}:{content_hash(path)}"
    else:
        identity = f"sha256:{content_hash(path)}"
    return FetchedModel(
        path=str(path),
        source=source,
        model_id=args.model_id,
        revision_requested=args.revision,
        revision_resolved=revision_resolved,
        identity=identity,
        size_bytes=folder_size(path),
        parameters=parameter_count(path),
        trust_remote_code=args.trust_remote_code,
        model_class=model_class,
        files=files,
    )


@task(
    name="fetch model",
    cache_policy=LocalSourceAware(),
    cache_expiration=CACHE_EXPIRATION,
    persist_result=True,
    retries=3,
    retry_delay_seconds=[5, 20, 60],
    retry_condition_fn=is_transient,
)
def fetch_model(args: ModelArgs, weights: bool = True) -> FetchedModel:
    """Fetch the model named by `args` and record its identity, size and parameter count.

    `weights=False` (validation) fetches a hub model's config and tokenizer only.
    """
    fetched = fetch(args, weights)
    run_logger(__name__).info(
        "Fetched %s from %s: %s, %.1f MB, %s parameters",
        args.model_id,
        fetched.source,
        fetched.identity,
        fetched.size_bytes / 1e6,
        f"{fetched.parameters:,}" if fetched.parameters is not None else "unknown",
    )
    tracking.log_result(fetched)
    return fetched


def resolve_compressed(args: ModelArgs) -> Path:
    """The compressed model's local folder (a path, a ClearML model id, a hub id, or the s3://
    or file:// prefix compress-model uploaded it to: downloaded into the cache only when its
    manifest vouches for every object), held to the same checks as a source folder but for
    being quantized: a folder missing its weights or with a config cut off is refused here,
    naming `compressed`, not in a stage as a defect.

    Not `fetch`: that refuses quantized models, which is exactly what is evaluated here.
    """
    if args.clearml_model:
        path = from_clearml(args)
    elif is_store_uri(args.model_id):
        path = fetch_store(
            args.model_id,
            args.storage_credentials,
            field="compressed.model_id",
            published_only=True,
        ).path
    elif (local := Path(args.model_id).expanduser()).exists():
        path = local.resolve()
    elif args.model_id.startswith((".", "/", "~")):
        raise ModelFetchError(
            "compressed.model_id",
            f"{args.model_id} does not exist on this worker",
            "publish it to object storage (output.upload_uri) and pass that s3:// or file:// "
            "URI, publish to storage every worker mounts, or pass a ClearML model id with "
            "clearml_model: true",
        )
    else:
        path = fetch_from_hub(args, hub_token(args.hub_token_block))[0]
    try:
        check_folder(path, args, quantized=True)
        check_has_weights(path)  # after check_folder: pickle-only weights are refused there
    except ModelFetchError as exc:  # its checks name the compress flow's field
        field = exc.field.replace("model.", "compressed.", 1)
        raise type(exc)(field, exc.problem, exc.fix) from None
    return path
