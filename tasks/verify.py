"""Verify: proves a staged checkpoint is what a server will load, and still the base model.

It reloads the checkpoint from disk the way a server does and checks, cheapest first:

1. quantization config: `config.json` carries a compressed-tensors `quantization_config`, and
   its format is not `dense` when the recipe quantizes (a dense save means the weights were not
   packed: same size as the original, and vLLM reads it as unquantized);
2. tensor names: every saved tensor belongs to a module of the source checkpoint, and every
   source tensor is still there (vLLM's loaders map checkpoints by the source's names), except
   those transformers does not load (old `rotary_emb.inv_freq` buffers, tied copies); a tensor
   saved under a source name has the source's shape (read from the headers: a reload of a
   compressed-tensors checkpoint does not report a wrong-shaped norm or weight, and the
   model-free path's one pass uses the source's copies of the unquantized tensors);
3. reload: transformers loads it with no missing, unexpected or mismatched keys (a missing key is
   silently initialised at random);
4. logits: on held-out texts its next-token logits agree with the base model's, captured before
   calibration (or, on the model-free path, which leaves the source as it is, in the same
   forward as the compressed model's) (cosine, KL, top-1 against `verify` thresholds);
5. vllm: vLLM, the server it is made for, loads it and scores the same texts close to the base
   model served the same way (compressflow/model/serving.py); run last, it takes seconds to a
   minute. A host whose vLLM build lacks the scheme's kernel records "not checked here".

A model-free run is also checked weight by weight (6. weights: every quantized weight, dequantized,
is close to the source's). Its reference, weights and logits checks share one forward of the
source read from disk, each sample in it twice and each FP8 Linear computing the second copy with
the output's weight: the source and the output are read once each. Its reload then checks the keys
on the meta device, from the safetensors headers, reading no weight again (a full reload would read
the output a second time and, with a forward, decompress it to disk and read it back). A run whose
weights were read from disk reloads with its weights on disk the same way, so verifying needs no
more memory than calibrating.

A failure raises VerificationError naming the check, the numbers and the fix; the flow then
publishes nothing. Either way the results go to the log, ClearML and a Prefect artifact.
"""

from __future__ import annotations

import gc
import json
import math
import resource
import time
from pathlib import Path
from typing import NamedTuple

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from compressflow import compat
from compressflow.compat import patch_reloads
from compressflow.data.text_sources import load_processor
from compressflow.errors import VerificationError
from compressflow.logs import run_logger
from compressflow.model.checkpoint import tensor_index
from compressflow.model.memory import load_offloaded, stage_offload_folder
from compressflow.model.serving import serve_and_score, vllm_python
from compressflow.model.streaming import streamed_model
from compressflow.model.tracing import meta_model, unloaded_tensors
from compressflow.params import DEFAULT_MODEL_CLASS, VerifyArgs
from compressflow.registries.thresholds import scheme_family
from compressflow.reporting import tracking
from compressflow.reporting.artifacts import artifact_key, display_name, logit_figures
from compressflow.reporting.model_card import edit_card, verification_list, with_verification
from compressflow.reporting.quality import (
    TOKENS_PER_FORWARD,
    compare_logits,
    forwards,
    logits_of,
    logits_streamed,
    read_reference,
)
from compressflow.reporting.reference import reference_samples, refuse_non_finite
from compressflow.results import (
    Calibration,
    FetchedModel,
    MemoryPlan,
    PublishedModel,
    RenderedRecipe,
    ServingCheck,
    Verification,
    VerificationCheck,
)
from compressflow.runtime.isolation import in_child
from compressflow.store.manifest import read_manifest, replace_manifest

# Which parameter each failed check points at, and what to do about it. "recipe" stands for the
# one the user gave the recipe in (recipe.preset or recipe.recipe).
FIELDS = {
    "quantization config": "recipe",
    "tensor names": "model.model_id",
    "reload": "recipe",
    "logits": "verify",
    "weights": "calibration.path",
    "vllm": "verify",
}
# FP8 (e4m3) keeps 3 mantissa bits: rounding moves a weight by at most ~6%, and a tensor's
# relative error stays far below that; a wrong scale or layout lands near or above 100%.
MAX_WEIGHT_ERROR = 0.1
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # as safetensors headers name them
# Name parts of quantization parameters (weight_scale, input_zero_point, weight_g_idx...).
QUANTIZATION_PARAMETERS = ("scale", "zero_point", "g_idx")
FIXES = {
    "quantization config": "the quantized modules were saved unpacked (often a Linear subclass "
    "compressed-tensors does not recognise); report the architecture, and meanwhile use a recipe "
    "whose targets name the module classes, or set output.save_compressed true",
    "tensor names": "the saved names and shapes must match the source checkpoint's for vLLM to "
    "load it; report the architecture (compressflow/registries/architectures.py holds "
    "per-family rules)",
    "reload": "the checkpoint does not reload cleanly; check the listed keys, and add their "
    "modules to the recipe's ignore list (a preset's: recipe_args `ignore`) if they should stay "
    "unquantized",
    "logits": "the compressed model's outputs moved too far from the base model's: leave the "
    "layers with the largest error unquantized (recipe ignore; the manifest lists errors per "
    "module), use more calibration samples or a scheme with more bits, or, if the loss is "
    "acceptable, relax verify.min_cosine / verify.max_kl / verify.min_top1",
    "vllm": "vLLM refused the output or scored it too far from the base model: a refusal names "
    "vLLM's reason (report the architecture and scheme; meanwhile try another scheme); for "
    "scores, use a gentler recipe or relax verify.vllm_max_perplexity_increase_pct / "
    "verify.vllm_min_top1; verify.vllm off publishes without serving it",
    "weights": "the model-free path wrote weights that do not dequantize to the source's: set "
    "calibration.path to classic, and report the model and scheme",
}


def check_quantization_config(staging: Path, recipe: RenderedRecipe) -> VerificationCheck:
    config = json.loads((staging / "config.json").read_text())
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    name = "quantization config"
    if quant is None:
        quantizes = recipe.scheme is not None
        detail = "none in config.json" + (
            f", but the recipe quantizes ({recipe.scheme})" if quantizes else ""
        )
        return VerificationCheck(name=name, passed=not quantizes, detail=detail)
    groups = quant.get("config_groups") or {}
    formats = {quant.get("format")} | {g.get("format") for g in groups.values()}
    formats.discard(None)
    packed = bool(groups) and formats != {"dense"}
    detail = f"{quant.get('quant_method')}, format {', '.join(sorted(formats)) or 'unset'}"
    return VerificationCheck(
        name=name,
        passed=packed or not groups,
        detail=detail if packed or not groups else f"{detail}: the weights were saved unpacked",
    )


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
            name="tensor names", passed=True, detail="skipped: not a safetensors checkpoint"
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
    return VerificationCheck(name="tensor names", passed=not problems, detail=detail)


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
        return None, VerificationCheck(name="reload", passed=False, detail=detail)
    problems = [
        f"{kind.replace('_', ' ')}: {sorted(map(str, keys))[:3]}"
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
        if (keys := info.get(kind))
    ]
    check = VerificationCheck(
        name="reload",
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
    return VerificationCheck(name="weights", passed=passed, detail=detail)


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
    (benchmarks/README.md, "Verification reads on the model-free path").
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
    logits: list, reference: dict, args: VerifyArgs, scheme: str | None
) -> tuple[VerificationCheck, dict]:
    """The compressed model's logits against the base's, within the scheme family's limits
    (compressflow/registries/thresholds.py) or those set in `verify`."""
    figures = compare_logits(reference["logits"], logits)
    cosine, kl, top1 = (figures[k] for k in ("cosine", "kl_divergence", "top1_agreement"))
    limits = args.logit_limits(scheme)
    passed = cosine >= limits.cosine and kl <= limits.kl and top1 >= limits.top1
    positions = sum(len(ids) for ids in reference["input_ids"])
    detail = (
        f"cosine {cosine:.4f} (min {limits.cosine}), KL {kl:.4f} nats (max {limits.kl}), "
        f"top-1 {top1:.1%} (min {limits.top1:.0%}) over {positions} positions; limits: "
        f"{limits_source(args, scheme)}"
    )
    if any(math.isnan(v) for v in figures.values()):
        detail = "the compressed model's logits are not finite (NaN or inf)"
    applied = {"min_cosine": limits.cosine, "max_kl": limits.kl, "min_top1": limits.top1}
    check = VerificationCheck(name="logits", passed=passed, detail=detail)
    return check, {**figures, "logit_limits": applied}


def limits_source(args: VerifyArgs, scheme: str | None) -> str:
    """Where the logits limits came from, as the check's detail says it."""
    given = [
        f"verify.{name}" for name in ("min_cosine", "max_kl", "min_top1") if getattr(args, name)
    ]
    family = f"the {scheme_family(scheme)} default" + (f" ({scheme})" if scheme else "")
    return family + (f", {', '.join(given)} as set" if given else "")


def check_vllm(
    staging: Path, model: FetchedModel, prompts: list[list[int]], args: VerifyArgs
) -> tuple[VerificationCheck, ServingCheck | None]:
    """Serve the output and the base model in vLLM on the held-out tokens, and judge it."""
    name = "vllm"
    if args.vllm == "off":
        return VerificationCheck(name=name, passed=False, checked=False, detail="off"), None
    served = serve_and_score(model.path, str(staging), prompts, model.trust_remote_code)
    if served.outcome == "refused":
        detail = f"vLLM {served.vllm_version} refused it: {served.reason}"
        return VerificationCheck(name=name, passed=False, detail=detail), served
    if served.outcome == "not checked":
        return VerificationCheck(
            name=name,
            passed=False,
            # required: this host was meant to prove it, and could not
            checked=args.vllm == "required",
            detail=served.reason,  # the verdict says "not checked here"
        ), served
    m = served.metrics
    passed = (
        m.perplexity_increase_pct <= args.vllm_max_perplexity_increase_pct
        and m.top1_agreement >= args.vllm_min_top1
    )
    detail = (
        f"served by vLLM {served.vllm_version}: perplexity {m.perplexity_increase_pct:+.2f}% "
        f"(max +{args.vllm_max_perplexity_increase_pct}%), top-1 {m.top1_agreement:.1%} (min "
        f"{args.vllm_min_top1:.0%}), {m.tokens} positions, {served.seconds:.0f} s"
    )
    return VerificationCheck(name=name, passed=passed, detail=detail), served


def verification_markdown(result: Verification, target: str, name: str) -> str:
    verdict = "passed" if result.passed else "FAILED: not published"
    figures = logit_figures(result)
    return (
        f"# Verification of {name}: {verdict}\n\n`{target}`\n\n"
        + (f"Against the base model: {figures}.\n\n" if figures else "")
        + verification_list(result)
    )


def run_checks(
    calibration: Calibration,
    model: FetchedModel,
    recipe: RenderedRecipe,
    plan: MemoryPlan,
    args: VerifyArgs,
) -> Verification:
    """Every check, in a process of its own (the reload holds the model)."""
    started = time.perf_counter()
    staging = Path(calibration.staging_path)
    checks = [
        check_quantization_config(staging, recipe),
        check_names(staging, Path(model.path), model.model_class, model.trust_remote_code),
    ]
    reference = load_reference(calibration)
    one_pass = None
    if plan.path == "model_free":  # the source is unchanged: its logits are taken here
        samples = reference_samples(load_processor(model), args)
        one_pass = one_pass_logits(staging, model, plan, samples)
        base = one_pass.base if one_pass else source_logits(model, plan, samples)
        refuse_non_finite(base, model, "while verifying its compressed copy")
        reference = {"input_ids": samples, "logits": base}
        checks.append(check_weights(staging, Path(model.path), one_pass and one_pass.errors))
    # The one pass read the output's weights already: its reload checks the keys, reading none.
    loaded, reload_check = reload(staging, model, plan, weights=one_pass is None)
    checks.append(reload_check)
    logits = one_pass.logits if one_pass else None
    if reference and loaded is not None and logits is None:
        logits = logits_of(loaded, reference["input_ids"])
    del loaded
    figures: dict = {}
    if logits is not None:
        logits_check, figures = check_logits(logits, reference, args, recipe.scheme)
        checks.append(logits_check)
    served = None
    if reference and all(check.passed for check in checks):  # vLLM last: the slowest check
        vllm_check, served = check_vllm(staging, model, reference["input_ids"], args)
        checks.append(vllm_check)
    return Verification(
        passed=all(check.passed or not check.checked for check in checks),
        checks=checks,
        vllm=served,
        seconds=round(time.perf_counter() - started, 3),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **figures,
    )


@task(name="verify", cache_policy=NO_CACHE)
def verify(
    calibration: Calibration,
    model: FetchedModel,
    recipe: RenderedRecipe,
    plan: MemoryPlan,
    args: VerifyArgs,
    target: str,
) -> Verification:
    """Reload the staged checkpoint and prove it; raise VerificationError when it fails."""
    with stage_offload_folder(plan, "verify") as own:
        result = in_child(run_checks, calibration, model, recipe, own, args)
    log = run_logger(__name__)
    for check in result.checks:
        (log.info if check.passed else log.error if check.checked else log.warning)(
            "verify %s: %s: %s", check.name, check.verdict(), check.detail
        )
    tracking.log_result(result)
    create_markdown_artifact(
        verification_markdown(result, target, display_name(model.model_id, recipe.source)),
        key=artifact_key(model.model_id, recipe.source, "verification"),
    )
    if not result.passed:
        first = result.failed()[0]
        field = FIELDS[first.name]
        raise VerificationError(
            recipe.given_in() if field == "recipe" else field,
            "the compressed model failed verification and was not published: "
            + "; ".join(f"{check.name}: {check.detail}" for check in result.failed()),
            FIXES[first.name],
        )
    return result


def vllm_not_run(published: PublishedModel, args: VerifyArgs) -> bool:
    """Whether a reused output was published without vLLM's check (no vLLM environment then)
    and this worker can run it now: then a reuse checks it rather than report a stale "not
    checked". An output vLLM ran on and could not serve on that host is not checked again."""
    if args.vllm == "off" or vllm_python() is None:
        return False
    manifest = read_manifest(Path(published.path))
    served = manifest.verification.vllm if manifest and manifest.verification else None
    return served is None or served.vllm_version is None


def serve_published(
    published: PublishedModel, model: FetchedModel, args: VerifyArgs
) -> tuple[VerificationCheck, ServingCheck | None]:
    """vLLM's check of a published folder, on the held-out tokens verify uses."""
    prompts = reference_samples(load_processor(model), args)
    return check_vllm(Path(published.path), model, prompts, args)


@task(name="verify", cache_policy=NO_CACHE)
def verify_reused(published: PublishedModel, model: FetchedModel, args: VerifyArgs) -> None:
    """Serve a reused output in vLLM (`vllm_not_run`) and record the verdict in its manifest and
    model card; VerificationError when vLLM refuses it or it misses vLLM's limits."""
    folder = Path(published.path)
    check, served = in_child(serve_published, published, model, args)
    manifest = read_manifest(folder)
    checks = [c for c in manifest.verification.checks if c.name != check.name] + [check]
    manifest.verification = manifest.verification.model_copy(
        update={
            "checks": checks,
            "vllm": served,
            "passed": all(c.passed or not c.checked for c in checks),
        }
    )
    replace_manifest(folder, manifest)
    edit_card(folder, lambda card: with_verification(card, manifest))
    log = run_logger(__name__)
    (log.info if check.passed else log.error if check.checked else log.warning)(
        "verify %s (reused output, published %s): %s: %s",
        check.name,
        manifest.created_at,
        check.verdict(),
        check.detail,
    )
    tracking.log_result(manifest.verification)
    if not manifest.verification.passed:
        raise VerificationError(
            FIELDS[check.name],
            f"{folder} was published without vLLM's check (none was available then), and vLLM "
            f"fails it now: {check.detail}; its manifest and card say so",
            FIXES[check.name] + "; rerun with output.overwrite: true to compress it again",
        )
