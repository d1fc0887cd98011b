"""Check 4, logits: the compressed model's next-token logits on held-out texts against the base
model's; and, for the model-free path, the one forward that gives both (and the weight errors)."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import NamedTuple

from compressflow.evaluation.quality import (
    TOKENS_PER_FORWARD,
    compare_logits,
    forwards,
    logits_of,
    logits_streamed,
    read_reference,
)
from compressflow.model.headers import tensor_index
from compressflow.model.offload import load_offloaded
from compressflow.model.streaming import streamed_model
from compressflow.params import VerifyArgs
from compressflow.registries.thresholds import default_limits
from compressflow.results import Calibration, FetchedModel, MemoryPlan, VerificationCheck
from compressflow.verification import Check, Verifying
from compressflow.verification.contract import recipe_contract
from compressflow.verification.weights import FP8_DTYPES, dequantized, relative_error_in_place


class OnePass(NamedTuple):
    base: list  # the source's logits: the reference
    logits: list  # the output's
    errors: dict[str, float]  # each FP8 weight's relative error against the source's


class RowsNotFirst(ValueError):
    """A Linear met its input without the batch's rows first: halves would not be the copies."""


def source_logits(model: FetchedModel, plan: MemoryPlan, samples: list[list[int]]) -> list:
    """The source's logits alone: streamed from its checkpoint, or loaded with its weights on
    disk when it cannot stream (loading reads every weight once more)."""
    logits = logits_streamed(streamed_model(model, Path(model.path)), samples)
    if logits is None:
        base = load_offloaded(model, plan)
        logits = logits_of(base, samples)
        del base
        gc.collect()
    return logits


def one_pass_logits(
    staging: Path, model: FetchedModel, plan: MemoryPlan, samples: list[list[int]]
) -> OnePass | None:
    """A model-free output's logits, the source's, and the weight errors, from one forward of the
    base model: the batch holds each sample twice, and each FP8 Linear computes the first copy
    with its own weight and the second with the output's (dequantized, inputs quantized as the
    scheme says). None when a quantized module has no Linear counterpart in the model
    transformers builds (renamed checkpoints, fused experts) or a Linear's input does not hold
    the batch's rows first: separate passes check those.

    The base streams from its checkpoint (compressflow/model/streaming.py), or is loaded with
    its weights on disk when it cannot: the source is read once for the reference and the check,
    and the output once. Before, the reference was its own pass, and reloading the output read it
    twice and wrote a float copy of the whole model that each forward read again
    (docs/benchmarks/verify.md, "Reads on the model-free path").
    """
    import torch
    from compressed_tensors.quantization import fake_quantize, preset_name_to_scheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors import safe_open

    index = tensor_index(staging)
    keys = set(index)
    quantized = sorted(
        name.rsplit(".", 1)[0]
        for name, info in index.items()
        if info.dtype in FP8_DTYPES and name.endswith(".weight") and f"{name}_scale" in keys
    )
    if not quantized:
        return None

    def read(name: str):  # opened per read: an open file keeps what it read resident
        with safe_open(str(index[name].file), framework="pt") as handle:
            return handle.get_tensor(name)

    activations = preset_name_to_scheme(plan.model_free_scheme, ["Linear"]).input_activations
    errors: dict[str, float] = {}
    batch = {"rows": 0, "length": 0, "misplaced": False}  # of the forward running now

    def copies(x):
        """(the base's rows, the compressed model's) of a Linear's input: [rows, length, ...]
        or flattened to [rows x length, ...], the base's copy first either way."""
        rows, length = batch["rows"], batch["length"]
        if x.shape[0] == rows * length or (x.shape[0] == rows and x.shape[1:2] == (length,)):
            return x.chunk(2)
        batch["misplaced"] = True
        raise RowsNotFirst(f"a Linear's input {tuple(x.shape)} does not start with {rows} rows")

    def compressed_forward(x, module, name):
        base, x = copies(x)
        source = module.weight  # read from the source checkpoint
        weight = dequantized(read, name, keys)
        if activations is not None:
            scale, zero_point = compute_dynamic_scales_and_zp(
                value=x, args=activations, module=module
            )
            x = fake_quantize(x, scale, zero_point, activations)
        compressed = torch.nn.functional.linear(x, weight.to(x.dtype), module.bias)
        if name not in errors:  # after the forward: the error is measured in place
            errors[name] = relative_error_in_place(weight, source.float())
        return torch.cat([torch.nn.functional.linear(base, source, module.bias), compressed])

    def wired(base) -> bool:
        modules = dict(base.named_modules())
        if any(not isinstance(modules.get(name), torch.nn.Linear) for name in quantized):
            return False
        for name in quantized:
            module = modules[name]
            module.forward = lambda x, m=module, name=name: compressed_forward(x, m, name)
        return True

    def both(base_model, samples: list[list[int]]) -> tuple[list, list]:
        """Each group once as the base and once as the compressed model, in one forward; at half
        the tokens of a lone pass, so it holds no more activations than one."""
        base: list = []
        compressed: list = []
        for group in forwards(samples, TOKENS_PER_FORWARD // 2):
            batch.update(rows=2 * len(group), length=max(map(len, group)))
            logits = logits_of(base_model, group + group, tokens_per_forward=math.inf)
            base += logits[: len(group)]
            compressed += logits[len(group) :]
        return base, compressed

    streamed = streamed_model(model, Path(model.path))
    if streamed is not None and not wired(streamed):
        return None  # the loaded model has the same modules: no need to load it to find out
    pair = logits_streamed(streamed, samples, forward=both)
    del streamed
    gc.collect()  # each wired module's forward refers to the module: a cycle
    if pair is None and not batch["misplaced"]:  # loading it would misplace them the same way
        errors.clear()
        base = load_offloaded(model, plan)
        if wired(base):
            try:
                pair = both(base, samples)
            except RowsNotFirst:
                pass
        del base
        gc.collect()
    return OnePass(*pair, errors) if pair else None


def load_reference(calibration: Calibration) -> dict | None:
    """The base model's logits and their token ids; None when calibration captured none."""
    return read_reference(Path(calibration.reference_path)) if calibration.reference_path else None


def check_logits(
    logits: list, reference: dict, args: VerifyArgs, scheme: str | None, method: str | None = None
) -> tuple[VerificationCheck, dict]:
    """The compressed model's logits against the base's, within the limits of the recipe's
    method or scheme family (compressflow/registries/thresholds.py) or those set in `verify`."""
    figures = compare_logits(reference["logits"], logits, reference["input_ids"])
    cosine, kl, top1 = (figures[k] for k in ("cosine", "kl_divergence", "top1_agreement"))
    limits = args.logit_limits(scheme, method)
    failed = [
        f"{what} (verify.{arg})"
        for what, arg, bad in (
            ("cosine below its minimum", "min_cosine", cosine < limits.cosine),
            ("KL above its maximum", "max_kl", kl > limits.kl),
            ("top-1 below its minimum", "min_top1", top1 < limits.top1),
        )
        if bad
    ]
    passed = not failed
    positions = sum(len(ids) for ids in reference["input_ids"])
    detail = (
        f"cosine {cosine:.4f} (min {limits.cosine}), KL {kl:.4f} nats (max {limits.kl}), "
        f"top-1 {top1:.1%} (min {limits.top1:.0%}) over {positions} positions; limits: "
        f"{limits_source(args, scheme, method)}"
    )
    if failed:
        detail += f"; failed: {', '.join(failed)}, set in verify to loosen"
    if any(math.isnan(v) for v in figures.values()):
        detail = "the compressed model's logits are not finite (NaN or inf)"
    applied = {"min_cosine": limits.cosine, "max_kl": limits.kl, "min_top1": limits.top1}
    check = VerificationCheck(name=CHECK.name, passed=passed, detail=detail)
    return check, {**figures, "logit_limits": applied}


def limits_source(args: VerifyArgs, scheme: str | None, method: str | None = None) -> str:
    """Where the logits limits came from, as the check's detail says it."""
    given = [
        f"verify.{name}" for name in ("min_cosine", "max_kl", "min_top1") if getattr(args, name)
    ]
    _, source = default_limits(scheme, method)
    return source + (f", {', '.join(given)} as set" if given else "")


def logits_check(state: Verifying) -> VerificationCheck | None:
    """The output's logits (the one pass's, or the reloaded model's) against the reference;
    None when there is nothing to compare (no reference, or the reload failed)."""
    logits = state.one_pass.logits if state.one_pass else None
    if state.reference and state.loaded is not None and logits is None:
        logits = logits_of(state.loaded, state.reference["input_ids"])
    state.loaded = None  # the last check that reads the model: its memory goes back
    if logits is None:
        return None
    method = recipe_contract(state.recipe).method()
    check, state.figures = check_logits(
        logits, state.reference, state.args, state.recipe.scheme, method
    )
    return check


CHECK = Check(
    name="logits",
    field="verify",
    fix="the compressed model's outputs moved too far from the base model's: leave the "
    "layers with the largest error unquantized (recipe ignore; the manifest lists errors per "
    "module), use more calibration samples or a scheme with more bits, or, if the loss is "
    "acceptable, relax verify.min_cosine / verify.max_kl / verify.min_top1",
    function=logits_check,
)
