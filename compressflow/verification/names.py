"""Check 2, tensor names: the saved tensors map onto the source checkpoint's, in its shapes, but
for what the recipe's kinds may change (compressflow/recipes/kinds.py, `contract_of`):
quantization adds its parameters to source modules, a rotation the transforms config.json's
transform_config declares, expert pruning drops whole experts of the MoE layers it touched, with
the router's rows and config.json's expert count following. Anything else is refused, named."""

from __future__ import annotations

import json
from pathlib import Path

from compressflow.model.headers import tensor_index
from compressflow.model.modules import header_modules
from compressflow.model.tracing import unloaded_tensors
from compressflow.model.transforms import online_transforms
from compressflow.params import DEFAULT_MODEL_CLASS
from compressflow.recipes.kinds import PARAMETERS, TRANSFORMS, Contract
from compressflow.results import VerificationCheck
from compressflow.verification import Check
from compressflow.verification.contract import expert_pruning, recipe_contract, transform_of

# Name parts of quantization parameters (weight_scale, input_zero_point, weight_g_idx...).
QUANTIZATION_PARAMETERS = ("scale", "zero_point", "g_idx")
# Quantization alone: what the check held every output to before contracts.
QUANTIZED = Contract(("quantization",), frozenset({PARAMETERS}))


def owner(name: str) -> str:
    """`model.layers.0.mlp.up_proj.weight_scale` -> `model.layers.0.mlp.up_proj`."""
    return name.rsplit(".", 1)[0]


def _config(folder: Path) -> dict:
    path = folder / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return config if isinstance(config, dict) else {}


def check_names(
    staging: Path,
    source: Path,
    model_class: str = DEFAULT_MODEL_CLASS,
    trust_remote_code: bool = False,
    contract: Contract = QUANTIZED,
) -> VerificationCheck:
    """Saved tensors map onto source modules, those under source names keep the source's
    shapes, and no source tensor went missing, but for what `contract` allows.

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
    config = _config(staging)
    quantizes = PARAMETERS in contract.allows
    experts = expert_pruning(contract, original, saved, _config(source), config)
    source_modules = {owner(name) for name in original}
    saved_modules = {owner(name) for name in saved}

    def on_source_module(name: str) -> bool:
        # Quantization adds tensors (weight_packed, weight_scale, input_scale...) to source
        # modules; kv-cache scales sit on the attention module, whose projections are there.
        return quantizes and (
            owner(name) in source_modules
            or any(module.startswith(owner(name) + ".") for module in source_modules)
        )

    declared = online_transforms(config) if TRANSFORMS in contract.allows else {}
    modules = header_modules(source) if declared else {}
    new = sorted(n for n in saved if n not in original and not experts.dropped(n))
    transforms = [n for n in new if declared and transform_of(n, declared, modules)]
    unknown = [n for n in new if n not in transforms and not on_source_module(n)]
    # A pruned expert's index saved anyway (the kept experts are renumbered 0..kept-1).
    unknown += sorted(n for n in saved if experts.dropped(n))
    dropped = sorted(
        name
        for name in original.keys() - unloaded
        if name not in saved
        and not (quantizes and owner(name) in saved_modules)  # weight -> weight_packed
        and not experts.dropped(name)
    )
    # A quantized weight is saved under a new name (weight_packed) or keeps its shape (FP8);
    # quantization parameters of a source quantized already may change shape legitimately; a
    # pruned layer's router (and fused experts) keep one row per kept expert.
    reshaped = []
    for name in sorted(saved.keys() & original.keys()):
        want = list(original[name].shape)
        if (rows := experts.rows(name)) is not None and want:
            want = [rows, *want[1:]]
        quantization = quantizes and any(
            part in name.rsplit(".", 1)[-1] for part in QUANTIZATION_PARAMETERS
        )
        if list(saved[name].shape) != want and not quantization:
            reshaped.append((name, want))
    problems = list(experts.problems)
    if reshaped:
        (first, want), more = reshaped[0], len(reshaped)
        expected = "expected" if experts.rows(first) is not None else "in the source"
        problems.append(
            f"{more} tensor(s) saved with another shape than the source's, e.g. {first} "
            f"{list(saved[first].shape)} saved, {want} {expected}"
        )
    if unknown:
        why = "not in the source" + (
            ", and not a transform config.json's transform_config declares" if declared else ""
        )
        problems.append(f"{len(unknown)} saved name(s) {why}, e.g. {unknown[:3]}")
    if dropped:
        what = ", not of a whole expert dropped" if experts.kept else ""
        problems.append(f"{len(dropped)} source tensor(s) missing{what}, e.g. {dropped[:3]}")
    allowed = []
    if transforms:
        allowed.append(f"{len(transforms)} transform tensor(s) its transform_config declares")
    if experts.kept:
        allowed.append(experts.summary())
    detail = "; ".join(problems) or "; ".join(
        [f"{len(saved)} tensors, on source modules, in the source's shapes", *allowed]
    )
    if unloaded:
        detail += f"; {len(unloaded)} source tensor(s) transformers does not load, not expected"
    return VerificationCheck(name=CHECK.name, passed=not problems, detail=detail)


CHECK = Check(
    name="tensor names",
    field="model.model_id",
    fix="the saved names and shapes must match the source checkpoint's (but for what the "
    "recipe's methods may change: docs/verification.md) for vLLM to load it; report the "
    "architecture and recipe (compressflow/registries/architectures.py holds per-family rules)",
    function=lambda state: check_names(
        state.staging,
        Path(state.model.path),
        state.model.model_class,
        state.model.trust_remote_code,
        recipe_contract(state.recipe),
    ),
)
