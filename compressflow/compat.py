"""Workarounds for the pinned libraries (transformers 5.17, llm-compressor 0.14.0.1).

Each one fixes a measured failure, says where it belongs upstream, and is safe to remove when
the pin moves past the fix (tests/test_architectures.py fails if it is still needed).
"""

from __future__ import annotations


def save_under_source_names(model, renames: tuple[tuple[str, str], ...]) -> None:
    """Make `save_pretrained` write per-expert Linears under the source checkpoint's names.

    llm-compressor splits a fused experts module (transformers 5 merges Mixtral's `w1`/`w3`
    into `gate_up_proj` on load) into per-expert `gate_proj`/`up_proj`/`down_proj` Linears to
    calibrate them, but at save transformers only reverts the renames its own conversions
    made, so the checkpoint mixes both schemes and vLLM finds no expert weights. Replacing the
    fused-expert converters by `renames` is the mechanism llm-compressor itself uses
    (`set_save_conversion_mapping`); its documented route (`patch_moe_mappings` with
    `load_context`) imports every transformers model and needs torchvision, which has no CPU
    wheel here.
    """
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    base = (
        getattr(model, "_weight_conversions", None)
        or get_checkpoint_conversion_mapping(model.config.model_type)
        or []
    )
    kept = [
        conversion
        for conversion in base
        if not (
            isinstance(conversion, WeightConverter)
            and any("experts" in target for target in conversion.target_patterns)
        )
    ]
    model._weight_conversions = kept + [WeightRenaming(src, dst) for src, dst in renames]


def patch_int8_moe_reload() -> None:
    """Let transformers 5.17 reload int8 (W8A8) MoE checkpoints; idempotent.

    W8A8 stores each expert as int8 `weight` + `weight_scale` (what vLLM's int8 MoE kernels
    read), but transformers' compressed-tensors quantizer expects packed weights
    (`weight_packed`) for every non-FP8 scheme when it merges experts, finds none, and raises
    "We encountered some issues during automatic conversion of the weights". This treats an
    unpacked 8-bit int scheme like FP8 (anchor `.weight$`, fold weight * scale). Upstream:
    transformers' `quantizer_compressed_tensors._is_fp8_scheme` / `DecompressExperts.convert`.
    """
    import torch
    import transformers.integrations.compressed_tensors as integration
    import transformers.quantizers.quantizer_compressed_tensors as quantizer

    if getattr(quantizer, "_compressflow_int8_moe", False):
        return

    def unpacked_8bit(scheme) -> bool:
        weights = getattr(scheme, "weights", None)
        return (
            weights is not None
            and weights.num_bits == 8
            and scheme.format in (None, "int-quantized", "float-quantized")
        )

    is_fp8 = quantizer._is_fp8_scheme
    update = quantizer.CompressedTensorsHfQuantizer.update_weight_conversions

    def update_weight_conversions(self, weight_conversions):
        quantizer._is_fp8_scheme = lambda scheme: is_fp8(scheme) or unpacked_8bit(scheme)
        try:
            return update(self, weight_conversions)
        finally:
            quantizer._is_fp8_scheme = is_fp8

    convert = integration.DecompressExperts.convert

    def convert_int8(
        self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kw
    ):
        scheme = self.scheme or integration.get_experts_scheme(
            self.hf_quantizer.compressor.quantization_config
        )
        if not (scheme.weights.type == "int" and unpacked_8bit(scheme)):
            return convert(
                self, input_dict, source_patterns, target_patterns, full_layer_name, **kw
            )
        out = {}
        for key, value in input_dict.items():
            if "weight_scale" in key:
                continue
            scale_key = key.replace(".weight", ".weight_scale")
            if scale_key not in input_dict:
                out[key] = value
                continue
            weights = value if isinstance(value, list) else [value]
            scales = input_dict[scale_key]
            scales = scales if isinstance(scales, list) else [scales]
            out[key] = torch.stack(
                [w.float() * s.float() for w, s in zip(weights, scales, strict=True)]
            )
        return out

    quantizer.CompressedTensorsHfQuantizer.update_weight_conversions = update_weight_conversions
    integration.DecompressExperts.convert = convert_int8
    quantizer._compressflow_int8_moe = True


def add_reloadable_ignore_names(folder, model) -> list[str]:
    """Make the saved ignore list name the modules a reload will have; returns names added.

    compressed-tensors 0.19 writes the ignore list in transformers 4's layout for models whose
    layout changed in transformers 5 (`language_model.lm_head`, `vision_tower.…`) while the
    weights are saved, and reloaded, under the new names (`lm_head`, `model.vision_tower.…`).
    Unmatched, the reload treats those layers as quantized with no scales: NaN logits. Each
    name is kept (vLLM maps checkpoint names) and the module it means is added beside it.
    """
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    quant = config.get("quantization_config")
    if not quant:
        return []
    modules = {name for name, _ in model.named_modules()}
    ignore, added = list(quant.get("ignore", [])), []
    for name in list(ignore):
        if name.startswith("re:") or name in modules:
            continue
        parts = name.split(".")
        for start in range(len(parts)):
            suffix = ".".join(parts[start:])
            hits = [m for m in modules if m == suffix or m.endswith("." + suffix)]
            if len(hits) == 1:
                if hits[0] not in ignore:
                    ignore.append(hits[0])
                    added.append(hits[0])
                break
    if added:
        quant["ignore"] = ignore
        path.write_text(json.dumps(config, indent=2))
    return added


def as_plain_linear(model, class_names: tuple[str, ...]) -> int:
    """Turn modules of `class_names` (nn.Linear subclasses with Linear's own math) into
    nn.Linear; returns how many.

    compressed-tensors infers the saved format from the exact module type, so an unknown
    subclass (FalconLinear) is saved unpacked (`format: dense`, the original's size) and left
    out of the ignore list, which makes the reload read lm_head as quantized.
    """
    import torch

    count = 0
    for module in model.modules():
        if type(module).__name__ in class_names and isinstance(module, torch.nn.Linear):
            module.__class__ = torch.nn.Linear
            count += 1
    return count


def patch_falcon_reload() -> None:
    """Let transformers 5.17 reload packed (W4A16) Falcon checkpoints; idempotent.

    `FalconPreTrainedModel._init_weights` reads `module.weight` on every FalconLinear, which a
    packed checkpoint replaces by `weight_packed`: from_pretrained raises AttributeError. The
    base class guards with getattr(..., None); this does the same. Upstream: transformers'
    modeling_falcon.
    """
    from transformers.modeling_utils import PreTrainedModel
    from transformers.models.falcon import modeling_falcon

    original = modeling_falcon.FalconPreTrainedModel._init_weights
    if getattr(original, "_compressflow", False):
        return

    def init_weights(self, module):
        if (
            isinstance(module, modeling_falcon.FalconLinear)
            and getattr(module, "weight", None) is None
        ):
            return PreTrainedModel._init_weights(self, module)
        return original(self, module)

    init_weights._compressflow = True
    modeling_falcon.FalconPreTrainedModel._init_weights = init_weights


def patch_reloads() -> None:
    """Every reload-side workaround above, for code that reloads compressed checkpoints."""
    patch_int8_moe_reload()
    patch_falcon_reload()
