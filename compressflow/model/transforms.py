"""The online transforms a compressed checkpoint declares (a QuIP rotation's `transform_config`),
attached when it loads, so every reader runs the model its weights make.

transformers loads the weights and leaves the transform tensors (`<module>.<group>_<location>.*`)
unloaded; without them a rotated model computes garbage (the yardstick's W4A16_QUIP scored a
held-out perplexity of 3,288 against 42 when evaluate-model loaded it so). compressed-tensors'
`apply_transform_config` attaches them as vLLM does, and the saved tensors fill them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Where a transform runs when the model does (compressed-tensors' TransformLocation.is_online):
# its tensor is saved; one fused into the weights (weight_input, weight_output) is not.
ONLINE = ("input", "output", "q_attn", "k_cache")


def quantization_config(config: dict) -> dict:
    """config.json's compressed-tensors `quantization_config` (a multimodal one's text_config's)."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    return quant if isinstance(quant, dict) else {}


def online_transforms(config: dict) -> dict[str, list[dict]]:
    """`{group}_{location}` (the submodule compressed-tensors registers) -> its apply entries
    (targets, ignore), for each online transform config.json's transform_config declares."""
    groups = (quantization_config(config).get("transform_config") or {}).get("config_groups")
    found: dict[str, list[dict]] = {}
    for group, scheme in (groups or {}).items():
        for entry in (scheme or {}).get("apply") or []:
            if entry.get("location") in ONLINE:
                found.setdefault(f"{group}_{entry['location']}", []).append(entry)
    return found


def declared_in(folder: Path) -> dict[str, list[dict]]:
    """`online_transforms` of the folder's config.json; empty without one, or without transforms."""
    config = folder / "config.json"
    return online_transforms(json.loads(config.read_text())) if config.is_file() else {}


def attach_transforms(loaded: Any, folder: Path, unloaded: set[str]) -> set[str]:
    """Attach the online transforms the folder's config.json declares (its transform_config less
    the locations fused into the weights) and fill each from the tensor saved for it, among the
    keys transformers left `unloaded`. Returns the keys it filled; the rest stay unexpected."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from safetensors import safe_open

    from compressflow.model.headers import tensor_index

    declared = declared_in(folder)
    config = json.loads((folder / "config.json").read_text())
    groups = quantization_config(config)["transform_config"]["config_groups"]
    online = {
        group: {
            **scheme,
            "apply": [a for a in scheme["apply"] if f"{group}_{a['location']}" in declared],
        }
        for group, scheme in groups.items()
    }
    apply_transform_config(
        loaded, TransformConfig(config_groups={g: s for g, s in online.items() if s["apply"]})
    )
    parameters = dict(loaded.named_buffers(remove_duplicate=False))
    parameters |= dict(loaded.named_parameters(remove_duplicate=False))
    filled = {name for name in unloaded if name in parameters}
    index = tensor_index(folder)
    for name in sorted(filled):
        with safe_open(str(index[name].file), framework="pt") as handle:
            parameters[name].data.copy_(handle.get_tensor(name))
    return filled
