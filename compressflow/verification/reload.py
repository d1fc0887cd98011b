"""Check 3, reload: transformers loads the checkpoint with no missing, unexpected or mismatched
keys (a missing key is silently initialised at random), through the model group's one loader
(`compressflow/model/loading.py`)."""

from __future__ import annotations

from pathlib import Path

from compressflow import compat
from compressflow.compat import patch_reloads
from compressflow.errors import InputError
from compressflow.model.loading import headers_load, incomplete, load_complete
from compressflow.results import FetchedModel, MemoryPlan, VerificationCheck
from compressflow.verification import Check, Verifying


def reload(staging: Path, model: FetchedModel, plan: MemoryPlan, weights: bool = True):
    """The checkpoint as transformers loads it, and a check on what it reported.

    It loads with what the checkpoint declares: config.json's expert count (a pruned MoE is
    built with the experts kept), and the online transforms of its transform_config, which
    compressed-tensors attaches (as vLLM does) and fills from the saved transform tensors: the
    only keys transformers may leave unloaded.

    `weights=False` loads onto the meta device from the safetensors headers alone, reading no
    weight: the same key matching, renames and quantizer hooks, for a checkpoint whose weights
    were read already (the model-free one pass). Returns the meta model then.
    """
    import transformers

    patch_reloads()
    offload = {}
    if plan.placement in ("disk", "shards"):  # what does not fit under the budget stays on disk
        offload = dict(
            device_map="auto",
            max_memory={"cpu": plan.weights_in_memory_bytes},
            offload_folder=plan.offload_folder,
            offload_buffers=True,
        )
    try:
        if weights:
            loaded = load_complete(
                getattr(transformers, model.model_class),
                staging,
                "the compressed model",
                field=CHECK.field,
                # a tensor we saved that nothing loads, declared transforms aside: a wrong save
                unexpected=False,
                dtype="auto",
                trust_remote_code=model.trust_remote_code,
                **offload,
            )
            if offload:  # accelerate's hooks -> compressed-tensors' offloading, as calibrate
                compat.offloaded_from_accelerate(loaded)
                compat.onload_weights_once(loaded)
        else:
            loaded, report = headers_load(staging, model.model_class, model.trust_remote_code)
            if problem := incomplete(report, staging, unexpected=False):
                raise InputError(CHECK.field, problem, CHECK.fix)
    except InputError as exc:  # the keys it reported
        detail = exc.problem + ("" if weights else " (checked from the headers)")
        return None, VerificationCheck(name=CHECK.name, passed=False, detail=detail)
    except Exception as exc:  # whatever transformers raises, the checkpoint does not reload
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None, VerificationCheck(name=CHECK.name, passed=False, detail=detail)
    check = VerificationCheck(
        name=CHECK.name,
        passed=True,
        detail=f"{type(loaded).__name__}, no missing or unexpected keys"
        + ("" if weights else " (checked from the headers)"),
    )
    return loaded.eval(), check


def reload_check(state: Verifying) -> VerificationCheck:
    """Reload the output; hands the model to the logits check. After a model-free one pass, which
    read the output's weights already, it checks the keys from the headers, reading none."""
    state.loaded, check = reload(state.staging, state.model, state.plan, state.one_pass is None)
    return check


CHECK = Check(
    name="reload",
    field="recipe",
    fix="the checkpoint does not reload cleanly; check the listed keys, and add their "
    "modules to the recipe's ignore list (a preset's: recipe_args `ignore`) if they should stay "
    "unquantized",
    function=reload_check,
)
