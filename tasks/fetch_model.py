"""Fetch model: resolves `model_id` to a local folder and records an immutable identity.

Three sources: a local folder (identity: a content hash of its files), the Hugging Face hub (a
snapshot at a revision; identity: the resolved commit sha; honours the local cache and
HF_HUB_OFFLINE) and the ClearML model registry (identity: the ClearML model id and content hash).
The hub token comes from a Prefect Secret block or HF_TOKEN, never from a flow parameter.

Cheap checks that would otherwise fail after minutes of loading run here, before weights load:
a config.json that is missing or not a JSON object, or whose sizes no model has, a model that
needs `trust_remote_code` or is already quantized, a folder without a tokenizer, truncated or
malformed safetensors, and a FIFO, device or folder where a model file should be.
"""

from __future__ import annotations

import json
import math
import os
import re
from fnmatch import fnmatch
from pathlib import Path

from prefect import task

from compressflow import compat
from compressflow.errors import HubUnavailableError, ModelFetchError, first_line
from compressflow.limits import CONFIG_CEILINGS, not_regular, read_json
from compressflow.logs import run_logger
from compressflow.model.checkpoint import HeaderError, read_header, tensor_index
from compressflow.params import DEFAULT_MODEL_CLASS, ModelArgs
from compressflow.reporting import tracking
from compressflow.results import FetchedModel
from compressflow.runtime.isolation import in_child
from compressflow.store.caching import CACHE_EXPIRATION, LocalSourceAware
from compressflow.store.disk_space import folder_size
from compressflow.store.identity import content_hash

# Weight formats we never calibrate from; skipping them halves downloads of repos that ship both
# safetensors and consolidated checkpoints (e.g. Llama's original/ folder).
HUB_IGNORE_PATTERNS = ["original/*", "*.pth", "*.gguf", "*.msgpack", "*.h5", "*.onnx", "*.ot"]
# What validation needs: config, tokenizer, processor and remote code, never weights.
HUB_CONFIG_PATTERNS = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py"]
# Files of a model folder that fetch or the loaders open: those and the weights.
MODEL_FILES = [*HUB_CONFIG_PATTERNS, "*.safetensors"]


def check_files(path: Path) -> None:
    """Refuse a FIFO, device, folder or broken link named as a file the loaders read: opening
    it would block forever, never end, or fail as an OSError the task retries."""
    for file in sorted(path.iterdir()):
        if any(fnmatch(file.name, pattern) for pattern in MODEL_FILES) and (
            kind := not_regular(file)
        ):
            raise ModelFetchError(
                "model.model_id",
                f"{file} is {kind}, not a regular file",
                f"replace {file.name} with the model's real file, or remove it",
            )


def load_model_json(file: Path):
    """A JSON file of the model's (config.json, the shard index), its parse errors worded."""
    try:
        return read_json(file, "model.model_id", ModelFetchError)
    except json.JSONDecodeError as exc:  # transformers would fail later with no file or field
        raise ModelFetchError(
            "model.model_id",
            f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            f"fix {file.name} at that position, or download the model again",
        ) from None
    except UnicodeDecodeError:
        raise ModelFetchError(
            "model.model_id",
            f"{file} is not UTF-8 text",
            f"replace {file.name} with the model's original",
        ) from None
    except ValueError as exc:  # e.g. an integer longer than Python converts (4,300 digits)
        raise ModelFetchError(
            "model.model_id",
            f"{file} cannot be read as JSON: {exc}",
            f"replace {file.name} with the model's original",
        ) from None


def check_config(path: Path, args: ModelArgs) -> dict:
    """Refuse, from config.json alone, models that would fail only after their weights load;
    returns the config."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFetchError(
            "model.model_id",
            f"{path} has no config.json, so it is not a transformers model folder",
            "point model_id at the folder that holds config.json and the weights",
        )
    # The first read of a user's config.json: capped, so later reads of it need not be.
    config = load_model_json(config_file)
    if not isinstance(config, dict):
        raise ModelFetchError(
            "model.model_id",
            f"{config_file} holds a JSON {type(config).__name__}, not an object of settings",
            "replace config.json with the model's original",
        )
    if (auto_map := config.get("auto_map")) and not args.trust_remote_code:
        raise ModelFetchError(
            "model.trust_remote_code",
            f"{args.model_id} defines its architecture in its own code (auto_map: "
            f"{sorted(auto_map) if isinstance(auto_map, dict) else auto_map!r:.80})",
            "set trust_remote_code: true if you trust this repository's code",
        )
    quantization = config.get("quantization_config") or config.get("compression_config")
    if quantization:
        named = quantization if isinstance(quantization, dict) else {}
        method = named.get("quant_method") or named.get("format") or "unknown"
        raise ModelFetchError(
            "model.model_id",
            f"{args.model_id} is already quantized ({method}); compressing it again would stack "
            "errors or fail to load",
            "start from the unquantized base model",
        )
    return config


def check_sizes(path: Path, config: dict, names: set[str]) -> None:
    """Refuse core sizes in config.json that no model has, before anything builds the model
    (the memory plan and tracing build it on the meta device): a wrong type, zero or negative
    fails there with no field named, and a huge one takes minutes or gigabytes even on meta.

    A vision-language model's language model reads its own `text_config`: both are checked.
    `names` are the checkpoint's tensor names.
    """
    config_file = path / "config.json"
    text = config.get("text_config")
    for where, settings in (("", config), ("text_config.", text if isinstance(text, dict) else {})):
        for key, ceiling in CONFIG_CEILINGS.items():
            value = settings.get(key)
            # Some configs list a size per layer (Gemma 3n's intermediate_size); null means unset.
            for item in value if isinstance(value, list) else [value]:
                if item is not None and not (
                    isinstance(item, int) and not isinstance(item, bool) and 0 < item <= ceiling
                ):
                    raise ModelFetchError(
                        "model.model_id",
                        f"{config_file} sets {where}{key} to {item!r:.80}; it must be a whole "
                        f"number from 1 to {ceiling:,}",
                        f"fix {where}{key} in config.json, or replace config.json with the "
                        "model's original",
                    )
    # Layers the checkpoint holds, where its tensor names number them (`model.layers.3.mlp...`).
    held = 1 + max((int(n) for n in LAYER_NUMBER.findall("\n".join(names))), default=-1)
    claimed = (text if isinstance(text, dict) and "num_hidden_layers" in text else config).get(
        "num_hidden_layers"
    )
    if held and isinstance(claimed, int) and claimed > held:
        raise ModelFetchError(
            "model.model_id",
            f"{config_file} sets num_hidden_layers to {claimed} but the checkpoint's weights "
            f"hold {held} layers",
            "fix num_hidden_layers in config.json to match the weights, or download the model "
            "again",
        )


# Files a tokenizer loads from (a processor holds its tokenizer's too): one must be there.
TOKENIZER_FILES = ("tokenizer*", "vocab.*", "merges.txt", "*.model", "*.tiktoken")
# A decoder layer's number in a tensor name: `model.layers.3.mlp.up_proj.weight`; a longer
# number than 9 digits is no layer's, and int() refuses one of thousands.
LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.", re.MULTILINE)


def check_tokenizer(path: Path) -> None:
    """Refuse a folder without a tokenizer: every run needs one, data-free recipes included
    (verification compares logits on tokenized text), and without it calibration fails only
    after the weights load."""
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ModelFetchError(
            "model.model_id",
            f"{path} holds no tokenizer (no tokenizer.json, tokenizer_config.json, "
            "tokenizer.model, vocab.* or *.tiktoken); calibration data and verification are "
            "tokenized with the model's own",
            "add the tokenizer files of the model it was trained from (its hub repository has "
            "them) to the folder; compressflow takes no separate tokenizer",
        )


def loading_class(path: Path, args: ModelArgs) -> str:
    """The transformers class that loads the model: `model_class`, or, with the default, the one
    config.json names when AutoModelForCausalLM would load something else (vision-language
    models: none at all, or Mllama's text-only class, which cannot read the full config)."""
    import transformers

    if args.model_class != DEFAULT_MODEL_CLASS or args.trust_remote_code:
        if not hasattr(transformers, args.model_class):
            raise ModelFetchError(
                "model.model_class",
                f"'{args.model_class}' is not a transformers class",
                "use a transformers class name, e.g. AutoModelForCausalLM",
            )
        return args.model_class
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = transformers.AutoConfig.from_pretrained(path)
    # What transformers raises for a config it cannot read: an unknown model_type, a dtype torch
    # lacks, a field of the wrong type.
    except (ValueError, TypeError, AttributeError, KeyError, StrictDataclassError) as exc:
        raise ModelFetchError(
            "model.model_id",
            f"transformers cannot read {path / 'config.json'}: {first_line(exc)}",
            "fix that field of config.json, or replace config.json with the model's original",
        ) from None
    mapping = compat.causal_lm_classes()
    default = mapping[type(config)].__name__ if type(config) in mapping else None
    named = [name for name in (config.architectures or []) if hasattr(transformers, name)]
    if default is not None and (not named or named[0] == default):
        return args.model_class
    if not named:
        raise ModelFetchError(
            "model.model_class",
            f"AutoModelForCausalLM cannot load {args.model_id} ({type(config).__name__}) and its "
            "config.json names no transformers class",
            "set model.model_class to the class that loads it, e.g. AutoModelForImageTextToText",
        )
    run_logger(__name__).info(
        "%s is a %s: loading it with %s", args.model_id, type(config).__name__, named[0]
    )
    return named[0]


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


def fetch_from_hub(args: ModelArgs, weights: bool = True) -> tuple[Path, str]:
    """Snapshot download at `args.revision`; returns the folder and the resolved commit sha."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = args.revision or "main"
    token = hub_token(args.hub_token_block)  # a missing block fails here, before any download
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


def fetch_from_clearml(args: ModelArgs) -> Path:
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
    tracking.current().connect_input_model(input_model)
    return Path(folder)


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

    With `weights=False` (validation) a hub model is fetched without its weight files.
    """
    revision_resolved = None
    if args.clearml_model:
        source, path = "clearml", fetch_from_clearml(args)
    elif Path(args.model_id).expanduser().exists():
        source, path = "local", Path(args.model_id).expanduser().resolve()
    elif args.model_id.startswith((".", "/", "~")) or os.sep * 2 in args.model_id:
        raise ModelFetchError(
            "model.model_id",
            f"local folder {args.model_id} does not exist",
            "fix the path (relative paths are resolved from the worker's working directory)",
        )
    else:
        source = "hub"
        path, revision_resolved = fetch_from_hub(args, weights)
    config = check_config(path, args)
    check_files(path)
    check_tokenizer(path)
    check_sizes(path, config, check_weight_files(path))
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
        model_class=in_child(loading_class, path, args),
    )


def shard_names(index: Path) -> set[str]:
    """The shard files model.safetensors.index.json lists in its `weight_map`."""
    data = load_model_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) for shard in weight_map.values()
    ):
        raise ModelFetchError(
            "model.model_id",
            f'{index} is not a shard index: it needs a "weight_map" object of tensor names to '
            "shard file names",
            f"replace {index.name} with the model's original, or download the model again",
        )
    return set(weight_map.values())


def check_weight_files(path: Path) -> set[str]:
    """Refuse truncated or corrupt safetensors (an interrupted download) by their headers alone;
    returns the names of the tensors they hold.

    A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte range,
    then the data: a file shorter than its header says is cut off, whatever loads it later.
    """
    fix = (
        "download the model again (delete the file, or its hub cache folder under HF_HOME, "
        "first), or restore it from where it was copied"
    )
    index = path / "model.safetensors.index.json"
    if index.exists():
        missing = sorted(shard_names(index) - {file.name for file in path.glob("*.safetensors")})
        if missing:
            raise ModelFetchError(
                "model.model_id", f"{path} lacks shards its index lists: {missing[:3]}", fix
            )
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        try:
            length, tensors = read_header(file)
        except HeaderError as exc:
            raise ModelFetchError(
                "model.model_id", f"{file} is not a readable safetensors file: {exc}", fix
            ) from None
        size = file.stat().st_size
        end = max(
            (spec["data_offsets"][1] for name, spec in tensors.items() if name != "__metadata__"),
            default=0,
        )
        if 8 + length + end > size:
            raise ModelFetchError(
                "model.model_id",
                f"{file} is truncated: its header describes {8 + length + end:,} bytes, the file "
                f"has {size:,}",
                fix,
            )
        names.update(name for name in tensors if name != "__metadata__")
    return names


def parameter_count(path: Path) -> int | None:
    """Parameters counted from safetensors headers (no weights read); None for other formats."""
    index = tensor_index(path)
    return sum(math.prod(info.shape) for info in index.values()) if index else None


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
    """The compressed model's local folder: a path, a ClearML model id, or a hub id.

    Not `fetch`: that refuses quantized models, which is exactly what is evaluated here.
    """
    if args.clearml_model:
        return fetch_from_clearml(args)
    local = Path(args.model_id).expanduser()
    if local.exists():
        return local.resolve()
    if args.model_id.startswith((".", "/", "~")):
        raise ModelFetchError(
            "compressed.model_id",
            f"{args.model_id} does not exist on this worker",
            "publish to storage every worker mounts (see the OutputSettings block), or pass a "
            "ClearML model id with clearml_model: true",
        )
    return fetch_from_hub(args)[0]
