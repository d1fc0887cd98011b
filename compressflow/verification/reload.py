"""Check 3, reload: transformers loads the checkpoint with no missing, unexpected or mismatched
keys (a missing key is silently initialised at random)."""

from __future__ import annotations

from pathlib import Path

from compressflow import compat
from compressflow.compat import patch_reloads
from compressflow.model.tracing import meta_model
from compressflow.results import FetchedModel, MemoryPlan, VerificationCheck
from compressflow.verification import Check


def reload(staging: Path, model: FetchedModel, plan: MemoryPlan, weights: bool = True):
    """The checkpoint as transformers loads it, and a check on what it reported.

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
            loaded, info = getattr(transformers, model.model_class).from_pretrained(
                staging,
                dtype="auto",
                trust_remote_code=model.trust_remote_code,
                output_loading_info=True,
                **offload,
            )
            if offload:  # accelerate's hooks -> compressed-tensors' offloading, as calibrate
                compat.offloaded_from_accelerate(loaded)
                compat.onload_weights_once(loaded)
        else:
            loaded, info = reload_keys(staging, model)
    except Exception as exc:  # whatever transformers raises, the checkpoint does not reload
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None, VerificationCheck(name=CHECK.name, passed=False, detail=detail)
    problems = [
        f"{kind.replace('_', ' ')}: {sorted(map(str, keys))[:3]}"
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
        if (keys := info.get(kind))
    ]
    check = VerificationCheck(
        name=CHECK.name,
        passed=not problems,
        detail=("; ".join(problems) or f"{type(loaded).__name__}, no missing or unexpected keys")
        + ("" if weights else " (checked from the headers)"),
    )
    return loaded.eval(), check


def reload_keys(staging: Path, model: FetchedModel):
    """`from_pretrained` of the checkpoint's tensors as empty meta tensors: (meta model, info).

    transformers takes a state dict only without a folder, so the class is the concrete one the
    config names (an Auto class resolves it from a folder).
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        staging, trust_remote_code=model.trust_remote_code
    )
    cls = type(meta_model(config, model.model_class, model.trust_remote_code))
    return cls.from_pretrained(
        None,
        config=config,
        state_dict=compat.headers_state_dict(staging),
        dtype="auto",
        output_loading_info=True,
        device_map="meta",
    )


CHECK = Check(
    name="reload",
    field="recipe",
    fix="the checkpoint does not reload cleanly; check the listed keys, and add their "
    "modules to the recipe's ignore list (a preset's: recipe_args `ignore`) if they should stay "
    "unquantized",
    function=reload,
)
