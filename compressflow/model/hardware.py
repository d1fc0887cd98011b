"""What the worker's hardware (or the model's dtype) cannot run, refused before weights load.

Without this, a recipe that needs an accelerator fails in calibration, after the model was
fetched and its weights loaded. Measured on CPU-only torch with llm-compressor 0.14: AWQ fails;
GPTQ, SmoothQuant, RTN, AutoRound, SparseGPT, Wanda and SpinQuant run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from compressflow.errors import RecipeError
from compressflow.results import FetchedModel, RenderedRecipe

FP4_SCHEMES = ("NVFP4", "NVFP4A16", "MXFP4", "MXFP4A16")

# Modifier -> why it needs an accelerator.
NEEDS_ACCELERATOR: dict[str, str] = {
    "AWQModifier": "llm-compressor's AWQ pins its cached activations in page-locked memory, which "
    "needs one (calibration would fail with 'Cannot access accelerator device when none is "
    "available' after the weights load)",
}


def accelerator() -> str | None:
    """The accelerator torch sees in this process (`cuda`, `xpu`...), or None."""
    import torch

    return (
        torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
    )


def _why_none() -> str:
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return f"torch {torch.__version__} is a CPU-only build"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "torch sees no GPU" + (
        f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""
    )


def needs_accelerator(recipe: RenderedRecipe) -> list[str]:
    """The recipe's modifiers that need an accelerator: from their names, without torch."""
    return [name for name in recipe.modifiers if name in NEEDS_ACCELERATOR]


def refuse_unsupported(recipe: RenderedRecipe) -> None:
    """Raise RecipeError if this worker cannot run the recipe's modifiers; before any weights load."""
    needing = needs_accelerator(recipe)
    if not needing or accelerator() is not None:
        return
    field = recipe.given_in()
    scheme = recipe.scheme or "as given"
    if recipe.scheme in ("W4A16", "W4A16_ASYM"):  # the W4A16_AWQ preset's is asymmetric
        on_cpu = "use preset W4A16 (GPTQ, int4 weights in groups of 128), which runs on CPU"
    else:
        on_cpu = f"replace {' and '.join(needing)} with GPTQModifier (scheme {scheme}), which runs on CPU"
    raise RecipeError(
        field,
        f"{', '.join(needing)} (scheme {scheme}) needs a CUDA GPU worker: this worker has no "
        f"accelerator ({_why_none()}), and "
        + "; ".join(NEEDS_ACCELERATOR[name] for name in needing),
        f"run it on the gpu work pool (a worker whose torch sees a GPU), or {on_cpu}",
    )


def refuse_fp4_on_float32(recipe: RenderedRecipe, model: FetchedModel) -> None:
    """FP4 on a float32 checkpoint: compressed-tensors unpacks FP4 weights as bf16, so the
    reloaded model mixes float32 and bf16 and fails verification after calibration (measured)."""
    if recipe.scheme not in FP4_SCHEMES:
        return
    config = json.loads((Path(model.path) / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype != "float32":
        return
    raise RecipeError(
        recipe.given_in(),
        f"{recipe.scheme} needs a bf16 or fp16 model, and {model.model_id} is float32 "
        "(compressed-tensors unpacks FP4 weights as bf16, so the result would not reload)",
        "save the model in bf16 first (model.to(torch.bfloat16).save_pretrained(...); real "
        "checkpoints ship in bf16), or pick an FP8 or int preset",
    )
