"""The one adapter to library internals: every private or non-public name compressflow uses.

Two kinds of entry, each with the public API it stands in for:
- Accessors: a name the libraries do not export publicly (an underscored attribute, a module
  path outside their documented API). Each says what is missing upstream. The next upgrade of
  llm-compressor, compressed-tensors, transformers, torch or clearml is this file's work:
  `tools/check_layers.py` refuses a private name anywhere else.
- Workarounds for the pinned libraries (transformers 5.17, llm-compressor 0.14.0.1). Each fixes a
  measured failure, says where it belongs upstream, and is safe to remove when the pin moves past
  the fix (tests/matrix/test_architectures.py fails if it is still needed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

# ---------------------------------------------------------------- accessors


def modifier_classes() -> dict[str, type]:
    """Modifier name -> class, as llm-compressor's recipe parser looks them up.

    Missing upstream: a public listing of registered modifiers; `ModifierFactory` keeps them in
    private registries, filled by the same lazy load `Recipe.from_dict` does.
    """
    from llmcompressor.modifiers import ModifierFactory

    if not ModifierFactory._loaded:
        ModifierFactory.refresh()
    classes = {
        **ModifierFactory._main_registry,
        **ModifierFactory._experimental_registry,
        **ModifierFactory._registered_registry,
    }
    classes.pop("Modifier", None)  # the abstract base class is registered too
    return classes


def smoothquant_mappings() -> dict:
    """SmoothQuant's per-architecture mappings (architecture name -> mappings).

    Missing upstream: the registry lives in `llmcompressor.modifiers.transform.smoothquant.utils`,
    not exported by the modifier package.
    """
    from llmcompressor.modifiers.transform.smoothquant.utils import MAPPINGS_REGISTRY

    return MAPPINGS_REGISTRY


def smoothquant_mappings_named(architecture: str) -> list:
    """The mappings SmoothQuant picks for a model class named `architecture` (its registry's,
    else its default), without the model: what a recipe without mappings smooths.

    Missing upstream: `DEFAULT_SMOOTHQUANT_MAPPINGS` and the registry sit in the modifier's
    `utils` module, not exported.
    """
    from llmcompressor.modifiers.transform.smoothquant.utils import (
        DEFAULT_SMOOTHQUANT_MAPPINGS,
        MAPPINGS_REGISTRY,
    )

    return MAPPINGS_REGISTRY.get(architecture, DEFAULT_SMOOTHQUANT_MAPPINGS)


def default_smoothquant_mappings(model) -> list:
    """The mappings SmoothQuant picks for `model` when a recipe gives none.

    Missing upstream: `get_layer_mappings_from_model` sits in the modifier's `dynamic_mappings`
    module, not exported.
    """
    from llmcompressor.modifiers.transform.smoothquant.dynamic_mappings import (
        get_layer_mappings_from_model,
    )

    return get_layer_mappings_from_model(model)


def resolve_smoothquant_mappings(modifier, model):
    """What SmoothQuant's mappings resolve to on `model`; raises as the modifier would.

    Missing upstream: a public dry run of `SmoothQuantModifier._resolve_mappings`.
    """
    return modifier._resolve_mappings(model)


def is_quantizing_modifier(modifier) -> bool:
    """Whether `modifier` quantizes (and so checks group sizes when it initializes).

    Missing upstream: `QuantizationMixin` lives in `modifiers.quantization.quantization.mixin`,
    not exported.
    """
    from llmcompressor.modifiers.quantization.quantization.mixin import QuantizationMixin

    return isinstance(modifier, QuantizationMixin)


def layers_indivisible_by_group_size(model, targets, ignore) -> list[tuple[str, int, int]]:
    """(name, columns, group size) of the layers group quantization would refuse after load.

    Missing upstream: the check (`modifiers.quantization.group_size_validation`) is not exported
    and runs only inside the modifier's `on_initialize`, once the weights are in memory.
    """
    from llmcompressor.modifiers.quantization.group_size_validation import (
        get_layers_indivisible_by_group_size,
    )

    return get_layers_indivisible_by_group_size(model, targets, ignore)


def trace_subgraphs(model, sample_input, targets, ignore):
    """llm-compressor's sequential tracer: the subgraphs calibration will run.

    Missing upstream: `trace_subgraphs` is a helper of the sequential pipeline
    (`llmcompressor.pipelines.sequential.helpers`), not a public entry point.
    """
    from llmcompressor.pipelines.sequential.helpers import trace_subgraphs as trace

    return trace(model, sample_input, targets, ignore)


class SequentialPipelineParts(NamedTuple):
    """llm-compressor's sequential pipeline, in the pieces a copy of its loop runs on."""

    CalibrationPipeline: type  # the pipeline registry: `register`, `from_modifiers`
    SequentialPipeline: type  # what `from_modifiers` picks for a pass that needs data
    IntermediatesCache: type  # the activations between subgraphs
    handle_sequential_oom: Callable  # the decorator that turns an OOM into advice
    trace_subgraphs: Callable  # (model, sample_input, targets, ignore, targets_per_subgraph)
    get_batches: Callable  # (activations, num_batches, input_names, desc, prefetch)


def sequential_pipeline_parts() -> SequentialPipelineParts:
    """What compressflow.calibration.pipeline's copy of the sequential loop needs from the library.

    Missing upstream (llm-compressor issue #1410): a sequential pipeline that can start at a
    subgraph, take an activations cache and call back after each subgraph; without one the
    loop is copied, and the copy needs these pieces of `llmcompressor.pipelines`, which is not
    public API (`_get_batches` is private besides).
    """
    from llmcompressor.pipelines.cache import IntermediatesCache
    from llmcompressor.pipelines.registry import CalibrationPipeline
    from llmcompressor.pipelines.sequential.helpers import handle_sequential_oom, trace_subgraphs
    from llmcompressor.pipelines.sequential.pipeline import SequentialPipeline, _get_batches

    return SequentialPipelineParts(
        CalibrationPipeline,
        SequentialPipeline,
        IntermediatesCache,
        handle_sequential_oom,
        trace_subgraphs,
        _get_batches,
    )


@contextmanager
def restored_torch_functions() -> Iterator[None]:
    """Put back the torch state llm-compressor's tracer changes, however the trace ends.

    In 0.14.0.1 `HFTracer.patch_for_tracing` restores the torch functions it wraps after a
    successful trace only: a failed one leaves `torch.arange`, `torch.zeros`... wrapped for the
    rest of the process, and every model built afterwards gets garbage rotary frequencies (NaN
    logits). And the tracer registers each traced forward's namespace, which holds the model,
    in torch.fx's module-level `_wrapped_fns_to_patch`, which nothing clears: the calibrated
    model would stay in memory beside the checkpoint verify reloads. Missing upstream: a tracer
    that restores on failure, and a public way to clear torch.fx's patch list.
    """
    import torch
    import torch.fx._symbolic_trace as symbolic_trace
    from llmcompressor.pipelines.sequential.transformers_helpers import HFTracer

    originals = {name: getattr(torch, name) for name in HFTracer._TORCH_METHODS_TO_PATCH}
    wrapped = dict(symbolic_trace._wrapped_fns_to_patch)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch, name, function)
        symbolic_trace._wrapped_fns_to_patch.clear()
        symbolic_trace._wrapped_fns_to_patch.update(wrapped)


def model_from_config(cls, config):
    """A concrete transformers class built from `config` (the caller picks the device context).

    Missing upstream: concrete model classes have no public `from_config`; only the Auto
    classes do, and they would re-resolve the class from the config.
    """
    return cls._from_config(config)


def headers_state_dict(files) -> dict:
    """Every tensor of the safetensors `files`, as an empty meta tensor of its shape and dtype;
    read from the files' headers.

    Missing upstream: `transformers.modeling_utils.load_state_dict(map_location="meta")` is the
    only reader that maps safetensors dtypes the way transformers' loader does.
    """
    from transformers.modeling_utils import load_state_dict

    state: dict = {}
    for file in files:
        state.update(load_state_dict(str(file), map_location="meta"))
    return state


@contextmanager
def loading_reports() -> Iterator[list[dict]]:
    """What each `from_pretrained` inside reported of its keys, one dict per load: the
    `missing_keys`, `unexpected_keys` and `mismatched_keys` (name, shape in the files, shape in the
    model) `output_loading_info=True` returns, and `conversion_errors`. Recorded when the report
    is final (the keys transformers ties or ignores by design taken out), even when the load
    raises on it.

    Missing upstream: `output_loading_info=True` is the public way, but it changes what
    `from_pretrained` returns, and a wrapper around it expects the model alone:
    compressed-tensors' `load_offloaded_model` (the offloaded load, and a multi-GPU rank's)
    converts what it gets back. `PreTrainedModel._finalize_model_loading` is where every load's
    report passes, under any wrapper.
    """
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["_finalize_model_loading"]
    reports: list[dict] = []

    def recorded(model, load_config, loading_info):
        try:
            return original.__func__(model, load_config, loading_info)
        finally:
            reports.append(
                {
                    "missing_keys": set(loading_info.missing_keys),
                    "unexpected_keys": set(loading_info.unexpected_keys),
                    "mismatched_keys": {
                        (name, tuple(saved), tuple(expected))
                        for name, saved, expected in loading_info.mismatched_keys
                    },
                    "conversion_errors": dict(loading_info.conversion_errors),
                }
            )

    PreTrainedModel._finalize_model_loading = staticmethod(recorded)
    try:
        yield reports
    finally:
        PreTrainedModel._finalize_model_loading = original


def no_split_modules(model) -> list[str]:
    """The layer classes transformers keeps whole (the decoder layers), or [].

    Missing upstream: `_no_split_modules` is the only listing of a model's layer classes.
    """
    return list(model._no_split_modules or [])


def causal_lm_classes() -> dict:
    """Config class -> the class AutoModelForCausalLM builds for it.

    Missing upstream: the Auto class's `_model_mapping` is the only lookup that does not load.
    """
    import transformers

    return transformers.AutoModelForCausalLM._model_mapping


def ignored_on_load(model) -> set[str]:
    """The regexes of checkpoint names `model`'s class lets be absent or unused on load.

    Missing upstream: `_keys_to_ignore_on_load_unexpected` / `_missing` are the only listing
    (post_init merges the submodels' into the top model's).
    """
    unexpected = model._keys_to_ignore_on_load_unexpected or set()
    missing = model._keys_to_ignore_on_load_missing or set()
    return set(unexpected) | set(missing)


def loaded_names(model, names) -> dict[str, str]:
    """Checkpoint name -> the name `from_pretrained` loads it into on `model` (a meta model).

    Missing upstream: the renaming `from_pretrained` applies (the model's weight conversions,
    then the base-model prefix) is only reachable through `transformers.conversion_mapping` and
    `transformers.core_model_loading`, neither public.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state = model.state_dict()
    prefix = model.base_model_prefix
    result = {}
    for name in sorted(names, key=dot_natural_key):  # the order loading sees (group renames)
        renamed, _ = rename_source_key(name, renamings, converters, prefix, state)
        if renamed not in state and name in state:  # as loading does: keep the name, fix prefix
            renamed, _ = rename_source_key(name, [], [], prefix, state)
        result[name] = renamed
    return result


def offloaded_from_accelerate(model) -> None:
    """Turn accelerate's offload hooks on `model` into compressed-tensors' offloading.

    Missing upstream: `from_accelerate` lives in `compressed_tensors.offload.convert`, not
    exported by `compressed_tensors.offload`.
    """
    from compressed_tensors.offload.convert import from_accelerate

    from_accelerate(model)


def clearml_report_in_process() -> None:
    """Make ClearML report from this process instead of a forked reporter subprocess.

    The reporter's subprocess made `Task.close()` take 6-300 s (clearml 2.1.12); in-process
    reporting closes in ~0.02 s. Missing upstream: a public switch (the config key
    `sdk.development.report_use_subprocess` is read once, before a task is created).
    """
    from clearml.backend_interface.task.task import Task as BackendTask

    BackendTask._report_subprocess_enabled = False


def shared_compile_cache_dir() -> str:
    """torch.compile's host-wide default cache folder (`/tmp/torchinductor_<user>`).

    Missing upstream: torch documents TORCHINDUCTOR_CACHE_DIR but no public way to ask where
    the default is; `cache_dir_utils` is internal.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


# ---------------------------------------------------------------- workarounds


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


def onload_weights_once(model) -> None:
    """Make each quantized module of an offloaded `model` read its weights from disk once per
    forward instead of twice.

    compressed-tensors 0.19.0's `quantized_forward` onloads `self.weight`, then calls the class's
    forward, which onloads it again: on a reloaded model whose weights sit on disk, every forward
    read each quantized weight twice (docs/benchmarks/verify.md, "Reads on the model-free path").
    Keeping the onloaded tensors for the length of the module's own forward (`disable_offloading`,
    released on exit) reads them once. Belongs upstream in `quantized_forward`.
    """
    from compressed_tensors.offload import disable_offloading

    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue

        def forward(*args, _forward=module.forward, **kwargs):
            with disable_offloading():
                return _forward(*args, **kwargs)

        module.forward = forward


@contextmanager
def linears_built_without_init() -> Iterator[None]:
    """`torch.nn.Linear`s built inside skip their random initialization.

    llm-compressor 0.14.0.1's model-free path (`initialize_quantized_linear`) builds a Linear for
    every weight it quantizes, which kaiming-initializes a full-size weight, then copies the
    checkpoint's weight over it: on CPU, 2.8 of model_free_ptq's 8.8 s on a 1.87 GB model
    (docs/benchmarks/data-free-fp8.md). transformers' `no_init_weights` turns torch's init
    functions into no-ops while it is entered. Belongs upstream in `initialize_quantized_linear`
    (`torch.nn.utils.skip_init`, or build on the meta device).
    """
    from transformers.initialization import no_init_weights

    with no_init_weights():
        yield


def patch_reloads() -> None:
    """Every reload-side workaround above, for code that reloads compressed checkpoints."""
    patch_int8_moe_reload()
    patch_falcon_reload()
