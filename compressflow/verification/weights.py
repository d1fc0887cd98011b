"""Check 6, weights (model-free runs): every FP8 weight, dequantized, is close to the source's."""

from __future__ import annotations

import math
from pathlib import Path

from compressflow.model.headers import tensor_index
from compressflow.results import VerificationCheck
from compressflow.verification import Check

# FP8 (e4m3) keeps 3 mantissa bits: rounding moves a weight by at most ~6%, and a tensor's
# relative error stays far below that; a wrong scale or layout lands near or above 100%.
MAX_WEIGHT_ERROR = 0.1
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # as safetensors headers name them


def dequantized(read, module: str, keys: set[str]):
    """`module`'s weight as float32 from a compressed-tensors FP8 checkpoint (`read` returns a
    tensor by name); None for other formats."""
    import torch

    if f"{module}.weight_scale" not in keys:
        return None
    weight = read(f"{module}.weight")
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return None
    scale = read(f"{module}.weight_scale").float()
    # In place: one float copy of the weight, not two (a 400B model's verify dequantizes all).
    return weight.float().mul_(expanded(scale, weight.shape))


def expanded(scale, shape):
    """A weight scale broadcast to the weight's `shape`: per tensor, per row (`[rows, 1]`) or per
    block (`[row blocks, column blocks]`; a 384 x 128 weight in 128 x 128 blocks has a `[3, 1]`
    scale, which is not per row)."""
    if scale.dim() != 2 or tuple(scale.shape) in {(shape[0], 1), (1, 1), tuple(shape)}:
        return scale
    rows, cols = -(-shape[0] // scale.shape[0]), -(-shape[1] // scale.shape[1])
    scale = scale.repeat_interleave(rows, 0)[: shape[0]]
    return scale.repeat_interleave(cols, 1)[:, : shape[1]]


def relative_error_in_place(weight, expected) -> float:
    """||weight - expected|| / ||expected||. Subtracts in place, so `weight` holds the difference
    afterwards: no second full-size float tensor per weight (dequantize, error and forward of a
    5632 x 2048 weight: 138 -> 89 ms)."""
    from torch.linalg import vector_norm

    return (vector_norm(weight.sub_(expected)) / vector_norm(expected).clamp_min(1e-12)).item()


def check_weights(staging: Path, source: Path, found: dict[str, float] | None = None):
    """Every FP8 weight, dequantized, against the source's, one shard at a time; `found` holds
    the errors the one-pass check already measured (those weights are not read again)."""
    from safetensors import safe_open

    errors = dict(found or {})
    where = {name: info.file for name, info in tensor_index(source).items()}
    unchecked = 0
    for file in sorted(staging.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            keys = set(handle.keys())
            for scale in sorted(k for k in keys if k.endswith(".weight_scale")):
                module = scale.rsplit(".", 1)[0]
                if module in errors:
                    continue
                weight = dequantized(handle.get_tensor, module, keys)
                if weight is None or f"{module}.weight" not in where:
                    unchecked += 1
                    continue
                with safe_open(str(where[f"{module}.weight"]), framework="pt") as original:
                    errors[module] = relative_error_in_place(
                        weight, original.get_tensor(f"{module}.weight").float()
                    )
    # NaN counts as the worst
    worst_name = max(
        errors, key=lambda m: math.inf if math.isnan(errors[m]) else errors[m], default=""
    )
    worst = errors.get(worst_name, 0.0)
    passed = bool(errors) and worst <= MAX_WEIGHT_ERROR
    detail = (
        f"{len(errors)} weights dequantized, largest relative error {worst:.2%} "
        f"({worst_name or 'none'}; max {MAX_WEIGHT_ERROR:.0%})"
    )
    if unchecked:
        detail += f"; {unchecked} not in an FP8 format this check reads"
    if not errors:
        detail = "no FP8 weight to check" + (
            f" ({unchecked} in other formats)" if unchecked else ""
        )
    return VerificationCheck(name=CHECK.name, passed=passed, detail=detail)


CHECK = Check(
    name="weights",
    field="calibration.path",
    fix="the model-free path wrote weights that do not dequantize to the source's: set "
    "calibration.path to classic, and report the model and scheme",
    # Model-free runs only: the one pass (run.run_checks) measured the FP8 weights already.
    function=lambda state: (
        check_weights(
            state.staging, Path(state.model.path), state.one_pass and state.one_pass.errors
        )
        if state.plan.path == "model_free"
        else None
    ),
)
