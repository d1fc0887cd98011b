"""Downloads: a model's folder from the Hugging Face hub or the ClearML model registry.

The hub: a snapshot at a revision (identity: the resolved commit sha; honours the local cache and
HF_HUB_OFFLINE), its outages told apart from mistakes. The token is handed in: the fetch model
task reads it from a Prefect Secret block or leaves huggingface_hub to read HF_TOKEN, never from a
flow parameter. The folder's files are checked by `compressflow/model/folder_checks/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from compressflow.errors import HubUnavailableError, ModelFetchError
from compressflow.params import ModelArgs

if TYPE_CHECKING:
    from clearml import InputModel

# Weight formats we never calibrate from; skipping them halves downloads of repos that ship both
# safetensors and consolidated checkpoints (e.g. Llama's original/ folder).
HUB_IGNORE_PATTERNS = ["original/*", "*.pth", "*.gguf", "*.msgpack", "*.h5", "*.onnx", "*.ot"]
# What validation needs: config, tokenizer, processor and remote code, never weights.
HUB_CONFIG_PATTERNS = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py"]


def hub_outage(error: BaseException | None) -> str | None:
    """How the hub failed, when `error` is it being down or unreachable rather than a mistake."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    response = getattr(error, "response", None) if isinstance(error, HfHubHTTPError) else None
    if response is not None and (response.status_code >= 500 or response.status_code == 429):
        return f"answered {response.status_code} {response.reason_phrase}"
    if isinstance(error, (httpx.ConnectError, httpx.TimeoutException)):
        return f"could not be reached ({type(error).__name__}: {error})"
    return None


def hub_unavailable(args: ModelArgs, revision: str, outage: str) -> HubUnavailableError:
    """The error for one failed try, saying whether the task retries or gives up."""
    from huggingface_hub import constants
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    attempt = ""
    if context is not None:
        tries, total = context.task_run.run_count, context.task.retries + 1
        attempt = f" on try {tries} of {total}" + (
            "; giving up" if tries >= total else "; retrying"
        )
    return HubUnavailableError(
        "model.model_id",
        f"the hub ({constants.ENDPOINT}) {outage} for {args.model_id}@{revision}{attempt}",
        "retry later (https://status.huggingface.co), or download the model into HF_HOME where "
        "the hub is reachable and set HF_HUB_OFFLINE=1, or pass a local folder",
    )


def fetch_from_hub(args: ModelArgs, token: str | None, weights: bool = True) -> tuple[Path, str]:
    """Snapshot download at `args.revision`; returns the folder and the resolved commit sha.

    `token` None: huggingface_hub reads HF_TOKEN itself.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = args.revision or "main"
    try:
        folder = snapshot_download(
            args.model_id,
            revision=revision,
            token=token,
            ignore_patterns=HUB_IGNORE_PATTERNS,
            allow_patterns=None if weights else HUB_CONFIG_PATTERNS,
            # Offline, a commit-sha revision would still try the network: look in the cache.
            local_files_only=constants.is_offline_mode(),
        )
    except GatedRepoError as exc:
        raise ModelFetchError(
            "model.model_id",
            f"{args.model_id} is gated and the token has no access",
            "accept the licence on the hub and provide a token (hub_token_block or HF_TOKEN)",
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelFetchError(
            "model.model_id",
            f"no hub repository {args.model_id!r} (or it is private)",
            "check the id's spelling, or provide a token that can read it",
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelFetchError(
            "model.revision",
            f"{args.model_id} has no revision {revision!r}",
            "use an existing branch, tag or commit sha",
        ) from exc
    except LocalEntryNotFoundError as exc:
        # snapshot_download reports a hub outage as "not in the cache": tell them apart.
        if outage := hub_outage(exc.__cause__):
            raise hub_unavailable(args, revision, outage) from exc
        raise ModelFetchError(
            "model.model_id",
            f"{args.model_id}@{revision} is not in the local hub cache and the hub cannot be "
            "reached (offline: HF_HUB_OFFLINE is set or there is no network)",
            "download it once on a connected machine into HF_HOME, or pass a local folder",
        ) from exc
    # The snapshot folder is named after the commit it holds, whichever name was asked for.
    return Path(folder), Path(folder).name


def fetch_from_clearml(args: ModelArgs) -> tuple[Path, InputModel]:
    """A ClearML registry model's local copy: (folder, the InputModel, for the run's lineage)."""
    from clearml import InputModel

    try:
        input_model = InputModel(model_id=args.model_id)
        folder = input_model.get_local_copy()
    except ValueError as exc:
        raise ModelFetchError(
            "model.model_id",
            f"ClearML has no model {args.model_id!r} ({exc})",
            "copy the id from the ClearML model page, or set clearml_model: false for hub ids",
        ) from exc
    if not folder:
        raise ModelFetchError(
            "model.model_id",
            f"ClearML model {args.model_id!r} has no downloadable weights (offline mode cannot "
            "fetch registry models)",
            "configure a ClearML server (see docs/clearml.md) or pass the model's local folder",
        )
    return Path(folder), input_model
