"""Check 2, tensor names: the saved tensors map onto the source checkpoint's, in its shapes."""

from __future__ import annotations

from pathlib import Path

from compressflow.model.headers import tensor_index
from compressflow.model.tracing import unloaded_tensors
from compressflow.params import DEFAULT_MODEL_CLASS
from compressflow.results import VerificationCheck
from compressflow.verification import Check

# Name parts of quantization parameters (weight_scale, input_zero_point, weight_g_idx...).
QUANTIZATION_PARAMETERS = ("scale", "zero_point", "g_idx")


def owner(name: str) -> str:
    """`model.layers.0.mlp.up_proj.weight_scale` -> `model.layers.0.mlp.up_proj`."""
    return name.rsplit(".", 1)[0]


def check_names(
    staging: Path,
    source: Path,
    model_class: str = DEFAULT_MODEL_CLASS,
    trust_remote_code: bool = False,
) -> VerificationCheck:
    """Saved tensors map onto source modules, those under source names keep the source's
    shapes, and no source tensor went missing.

    Source tensors transformers never loads as weights of their own (old `rotary_emb.inv_freq`
    buffers, tied `lm_head.weight` copies, names the class ignores) cannot be saved again: they
    are not held against the output.
    """
    saved, original = tensor_index(staging), tensor_index(source)  # headers: no weight read
    if not saved or not original:
        return VerificationCheck(
            name=CHECK.name, passed=True, detail="skipped: not a safetensors checkpoint"
        )
    unloaded = unloaded_tensors(source, model_class, trust_remote_code)
    source_modules = {owner(name) for name in original}
    saved_modules = {owner(name) for name in saved}
    # Quantization adds tensors (weight_packed, weight_scale, input_scale...) to source modules;
    # kv-cache scales sit on the attention module, whose projections are in the source.
    unknown = sorted(
        name
        for name in saved
        if name not in original
        and owner(name) not in source_modules
        and not any(module.startswith(owner(name) + ".") for module in source_modules)
    )
    dropped = sorted(
        name
        for name in original.keys() - unloaded
        if name not in saved and owner(name) not in saved_modules
    )
    # A quantized weight is saved under a new name (weight_packed) or keeps its shape (FP8);
    # quantization parameters of a source quantized already may change shape legitimately.
    reshaped = sorted(
        name
        for name in saved.keys() & original.keys()
        if saved[name].shape != original[name].shape
        and not any(part in name.rsplit(".", 1)[-1] for part in QUANTIZATION_PARAMETERS)
    )
    problems = []
    if reshaped:
        first = reshaped[0]
        problems.append(
            f"{len(reshaped)} tensor(s) saved with another shape than the source's, e.g. {first} "
            f"{list(saved[first].shape)} saved, {list(original[first].shape)} in the source"
        )
    if unknown:
        problems.append(f"{len(unknown)} saved name(s) not in the source, e.g. {unknown[:3]}")
    if dropped:
        problems.append(f"{len(dropped)} source tensor(s) missing, e.g. {dropped[:3]}")
    detail = "; ".join(problems) or (
        f"{len(saved)} tensors, all on source modules, in the source's shapes"
    )
    if unloaded:
        detail += f"; {len(unloaded)} source tensor(s) transformers does not load, not expected"
    return VerificationCheck(name=CHECK.name, passed=not problems, detail=detail)


CHECK = Check(
    name="tensor names",
    field="model.model_id",
    fix="the saved names and shapes must match the source checkpoint's for vLLM to "
    "load it; report the architecture (compressflow/registries/architectures.py holds "
    "per-family rules)",
    function=lambda state: check_names(
        state.staging,
        Path(state.model.path),
        state.model.model_class,
        state.model.trust_remote_code,
    ),
)
