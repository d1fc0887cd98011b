"""Folder checks of config.json: a transformers model's settings, none that needs remote code or
is already quantized, and sizes some model has, against the layers the weights hold.
"""

from __future__ import annotations

import re
from pathlib import Path

from compressflow.errors import ModelFetchError
from compressflow.limits import CONFIG_CEILINGS
from compressflow.model.folder_checks import Folder, FolderCheck
from compressflow.model.folder_checks.files import load_model_json
from compressflow.params import ModelArgs

# A decoder layer's number in a tensor name: `model.layers.3.mlp.up_proj.weight`; a longer
# number than 9 digits is no layer's, and int() refuses one of thousands.
LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.", re.MULTILINE)


def check_config(path: Path, args: ModelArgs, quantized: bool = False) -> dict:
    """Refuse, from config.json alone, models that would fail only after their weights load;
    returns the config. `quantized`: the folder is a compressed model (evaluate-model's), whose
    quantization_config is expected."""
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
    model_type = config.get("model_type")
    if model_type is not None and not (isinstance(model_type, str) and model_type.strip()):
        raise ModelFetchError(
            "model.model_id",
            f"{config_file} sets model_type to {model_type!r:.80}; it must name an architecture, "
            "such as llama",
            "fix model_type in config.json, or replace config.json with the model's original",
        )
    if model_type is None and args.model_class.startswith("Auto") and not args.trust_remote_code:
        raise ModelFetchError(
            "model.model_id",
            f"{config_file} has no model_type, so transformers' {args.model_class} cannot tell "
            "which architecture to build",
            'add the model\'s model_type (e.g. "model_type": "llama") to config.json, or '
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
    if quantization and not quantized:
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


def _config(folder: Folder) -> None:
    folder.config = check_config(folder.path, folder.args, folder.quantized)


# Its auto_map refusal blames model.trust_remote_code.
CONFIG = FolderCheck("config", "model.model_id", _config)
SIZES = FolderCheck(
    "sizes",
    "model.model_id",
    lambda folder: check_sizes(folder.path, folder.config, folder.names),
    weights=True,
)
