"""Models on the meta device: every module and shape of a model, no weights in memory.

Used by the traceability check, the memory plan and the checks that run before anything loads.

The traceability check: the sequential pipeline partitions the model with torch.fx before
calibrating, and a model that does not trace fails there, after the weights are loaded and the data
is tokenized. `trace_config` runs the same trace up front, on a model built from its config alone
(accelerate `init_empty_weights`), with one real calibration sample, using llm-compressor's own
target inference and default ignore list. It takes seconds and well under a gigabyte even for
405B-sized configs (see `benchmarks/trace_configs.py`), and turns a trace failure into a
`TraceabilityError` that names the failing code and the recipe settings that get around it.
"""

from __future__ import annotations

import resource
import time
import traceback
from pathlib import Path

import yaml

from compressflow import compat
from compressflow.errors import ModelFetchError, RecipeError, TraceabilityError, interpreting
from compressflow.logs import run_logger
from compressflow.results import FetchedModel, RenderedRecipe, TraceReport


def meta_model(config, model_class: str = "AutoModelForCausalLM", trust_remote_code: bool = False):
    """`config`'s model on the meta device: every module and shape, no weights in memory."""
    import transformers
    from accelerate import init_empty_weights

    cls = getattr(transformers, model_class, None)
    if cls is None:
        raise TraceabilityError(
            "model.model_class",
            f"'{model_class}' is not a transformers class",
            "use one such as AutoModelForCausalLM",
        )
    # The class refusing what config.json sets (a rope setting, a dtype) is the file's fault.
    folder = getattr(config, "name_or_path", "")
    also = "" if model_class.startswith("Auto") else f", or check model.model_class ({model_class})"
    with (
        interpreting(
            "model.model_id",
            Path(folder) / "config.json" if folder else "the model's config.json",
            ModelFetchError,
            "transformers cannot build the model class from",
            more=also,
        ),
        init_empty_weights(),
    ):
        if hasattr(cls, "from_config"):  # an Auto class: it resolves the concrete class
            return cls.from_config(config, trust_remote_code=trust_remote_code)
        return compat.model_from_config(cls, config)  # a concrete class: the config names its code


def unloaded_tensors(folder, model_class: str, trust_remote_code: bool) -> set[str]:
    """Tensors of the checkpoint in `folder` that transformers does not load as weights of their
    own, so no checkpoint saved from the loaded model holds them (verify must not miss them).

    Decided as `from_pretrained` decides, on the meta model: names the class ignores on load,
    names that rename onto no parameter or persistent buffer (old Llamas' per-layer
    `rotary_emb.inv_freq`, `position_ids` now non-persistent), and tied copies (`lm_head.weight`
    saved beside the embeddings when the config ties them: loaded, then replaced by the tie).
    """
    import re
    from pathlib import Path

    from transformers import AutoConfig

    from compressflow.model.headers import tensor_index

    names = set(tensor_index(Path(folder)))
    if not names:
        return set()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = meta_model(config, model_class, trust_remote_code)
    kept = model.state_dict().keys() - set(model.all_tied_weights_keys)
    ignored = [re.compile(pattern) for pattern in compat.ignored_on_load(model)]
    return {
        name
        for name, loaded in compat.loaded_names(model, names).items()
        if loaded not in kept or any(pattern.search(loaded) for pattern in ignored)
    }


def outside_text_model(meta) -> list[str]:
    """Modules of a vision-language model that are not its language model: the vision tower and
    the projector, as the largest subtrees that hold an nn.Linear. [] for a text-only model.

    The language model is the submodule built from `config.get_text_config()`, found by that
    config, not by name; the output embeddings (`lm_head`) are the recipe's to ignore.
    """
    import torch

    text_config = meta.config.get_text_config()
    text = next((m for m in meta.modules() if getattr(m, "config", None) is text_config), meta)
    if text is meta:
        return []
    kept = {id(text), id(meta.get_output_embeddings())}
    found: list[str] = []

    def walk(module, prefix: str) -> None:
        for name, child in module.named_children():
            inside = {id(m) for m in child.modules()}
            if id(child) in kept:
                continue
            if inside & kept:  # an ancestor of the language model (`model`): look inside
                walk(child, f"{prefix}{name}.")
            elif any(isinstance(m, torch.nn.Linear) for m in child.modules()):
                found.append(f"{prefix}{name}")

    walk(meta, "")
    return found


def _maxrss_mb() -> float:
    # ru_maxrss is in kilobytes on Linux (the only platform this runs on).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def default_tracing_ignore() -> list[str]:
    """llm-compressor's default `tracing_ignore` (what `oneshot` uses when none is given)."""
    from llmcompressor.args import DatasetArguments

    return list(DatasetArguments().tracing_ignore)


def _failure_site(exc: BaseException) -> str:
    """'function (file:line): code' of the innermost frame outside torch and llm-compressor.

    llm-compressor re-raises failures inside its recompiled forwards as a RuntimeError carrying
    the whole source; the original exception (its __cause__) has the useful traceback.
    """
    import llmcompressor
    import torch

    root = exc.__cause__ or exc
    internal = (str(Path(torch.__file__).parent), str(Path(llmcompressor.__file__).parent))
    frames = traceback.extract_tb(root.__traceback__)
    for frame in reversed(frames):
        if not frame.filename.startswith(internal) and "contextlib" not in frame.filename:
            code = (frame.line or "").strip()
            return f"{frame.name} ({frame.filename}:{frame.lineno}){': ' + code if code else ''}"
    return ""


def _trace_error(exc: BaseException, targets: list[str], ignore: list[str]) -> TraceabilityError:
    root = exc.__cause__ or exc
    # The first line is the error; llm-compressor appends pages of recompiled source after it.
    detail = str(root).strip().splitlines()[0] if str(root).strip() else ""
    site = _failure_site(exc)
    where = f" in {site}" if site else ""
    function = site.split(" ", 1)[0] if site else ""
    # A failing line in a forward itself: the function to skip is the one called on that line.
    ignore_fix = (
        f"add '{function}' to recipe.tracing_ignore"
        if function and function != "forward"
        else "add the function called on the failing line to recipe.tracing_ignore"
    )
    return TraceabilityError(
        "recipe.tracing_ignore",
        f"the model does not trace for the sequential pipeline: {type(root).__name__}: {detail}"
        f"{where}. Current recipe.sequential_targets={targets}, recipe.tracing_ignore={ignore}",
        f"in order of preference: {ignore_fix} (the tracer then treats it as an opaque "
        "call); set recipe.sequential_targets to the model's decoder layer "
        "class so less of the model is traced; or set recipe.pipeline to 'basic', which does "
        "not trace (it calibrates the whole model at once, needing far more memory). "
        "'independent' is no way out: it runs the sequential pipeline for each data modifier",
    )


def check_quantized_layers(model: FetchedModel, recipe: RenderedRecipe) -> None:
    """Refuse now, on the meta device, a quantizing modifier that would quantize no layer, and
    layers that group quantization refuses after loading.

    llm-compressor takes targets that match nothing (or an ignore list that covers them all)
    and calibrates for nothing, and it checks `columns % group_size` when a modifier
    initializes, i.e. once the weights are in memory; both checks on the meta model cost a second.
    """
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.recipe import Recipe
    from transformers import AutoConfig

    # The rendered YAML is already validated: parse it as llm-compressor will.
    modifiers = [
        m
        for m in Recipe.from_dict(yaml.safe_load(recipe.yaml)).modifiers
        if compat.is_quantizing_modifier(m)
    ]
    if not modifiers:
        return
    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    quantized_by: dict[str, str] = {}  # layer -> the modifier that quantizes its weights first
    for number, modifier in enumerate(modifiers, 1):
        refuse_quantizing_nothing(modifier, recipe)
        meta = meta_model(config, model.model_class, model.trust_remote_code)
        targets, ignore = modifier.resolved_targets, modifier.ignore
        matched = [name for name, _ in match_named_modules(meta, targets, ignore)]
        if _quantizes_layers(modifier.resolved_config):
            refuse_quantized_twice(
                matched, f"{type(modifier).__name__} (modifier {number})", quantized_by, recipe
            )
        if not matched:
            raise RecipeError(
                recipe.given_in(),
                f"{type(modifier).__name__} would quantize no layer of {type(meta).__name__}: "
                f"its targets {sorted(targets)} less its ignore list {list(ignore or [])[:8]} "
                "match no module",
                "set targets to module classes or names the model has (e.g. Linear), and keep "
                "ignore to the layers that must stay unquantized",
            )
        if modifier.bypass_divisibility_checks:
            continue
        apply_quantization_config(meta, modifier.resolved_config)
        bad = compat.layers_indivisible_by_group_size(
            meta, modifier.resolved_targets, modifier.ignore
        )
        if bad:
            shown = ", ".join(f"{name} ({cols} columns)" for name, cols, _ in bad[:8])
            more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
            raise RecipeError(
                recipe.given_in(),
                f"{type(modifier).__name__} quantizes {len(bad)} layer(s) in groups of {bad[0][2]} "
                f"whose width is not a multiple of it: {shown}{more}; llm-compressor would refuse "
                "them only after loading the weights",
                "add those layers to the modifier's `ignore` list (a preset's: recipe_args "
                "`ignore`), use a group size that divides them, or set "
                "bypass_divisibility_checks: true if your runtime supports it",
            )


def _quantizes_layers(config) -> bool:
    """Whether a resolved quantization config quantizes some layer's weights or activations (a
    KV-cache-only one quantizes the cache alone)."""
    return any(
        getattr(scheme, part) is not None
        for scheme in config.config_groups.values()
        for part in ("weights", "input_activations", "output_activations")
    )


def refuse_quantizing_nothing(modifier, recipe: RenderedRecipe) -> None:
    """Refuse a quantizing modifier with no scheme, no config group that quantizes anything and
    no KV-cache scheme (`scheme: null`): llm-compressor failed on it only once the weights were
    loaded ("unable to find any modules to quantize")."""
    config = modifier.resolved_config
    if _quantizes_layers(config) or config.kv_cache_scheme is not None:
        return
    name = type(modifier).__name__
    raise RecipeError(
        recipe.given_in(),
        f"{name} quantizes nothing: it has no scheme, no config_groups with weights or "
        "activations, and no kv_cache_scheme",
        f"give {name} a scheme (e.g. W4A16) or config_groups, or remove it",
    )


def refuse_quantized_twice(
    matched: list[str], modifier: str, quantized_by: dict[str, str], recipe: RenderedRecipe
) -> None:
    """Refuse two quantizing modifiers on one layer: the later one re-quantizes what the earlier
    one calibrated, with its own scheme, and the checkpoint holds neither as the recipe reads.
    `quantized_by` maps the layers earlier modifiers quantize to them; `matched` are added."""
    twice = [name for name in matched if name in quantized_by]
    if twice:
        raise RecipeError(
            recipe.given_in(),
            f"{modifier} quantizes {len(twice)} layer(s) that {quantized_by[twice[0]]} already "
            f"quantizes, e.g. {', '.join(twice[:3])}: the later modifier would re-quantize what "
            "the earlier one calibrated, with its own scheme",
            "keep one quantizing modifier per layer: split their targets, or add the layers to "
            "one modifier's ignore list",
        )
    quantized_by.update(dict.fromkeys(matched, modifier))


def check_smoothquant_mappings(model: FetchedModel, recipe: RenderedRecipe) -> None:
    """Refuse now, on the meta device, SmoothQuant mappings that match nothing in this model.

    llm-compressor resolves them after the weights load and then fails with "Error resolving
    mappings for given architecture", naming neither the layer nor the fix. Mappings whose
    layers are all in the modifier's `ignore` fail nothing (llm-compressor skips them): that is
    only warned about.
    """
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from llmcompressor.recipe import Recipe
    from transformers import AutoConfig

    modifiers = [
        m
        for m in Recipe.from_dict(yaml.safe_load(recipe.yaml)).modifiers
        if isinstance(m, SmoothQuantModifier)
    ]
    if not modifiers:
        return
    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    meta = meta_model(config, model.model_class, model.trust_remote_code)
    for modifier in modifiers:
        given = modifier.mappings is not None
        modifier.mappings = modifier.mappings or compat.default_smoothquant_mappings(meta)
        try:
            resolved = compat.resolve_smoothquant_mappings(modifier, meta)
            if not resolved and modifier.ignore and _resolve_unignored(modifier, meta):
                run_logger(__name__).warning(
                    "SmoothQuant will smooth nothing in %s: every layer its mappings match is in "
                    "its ignore list %s, so llm-compressor skips them all and the recipe's other "
                    "modifiers run unsmoothed",
                    type(meta).__name__,
                    modifier.ignore,
                )
                continue
            problem = "" if resolved else "they match no layer"
        except (RuntimeError, ValueError, KeyError) as exc:
            cause = exc.__cause__ or exc
            problem = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        if problem:
            which = "the recipe's" if given else "llm-compressor's default"
            shown = [
                [getattr(m, "balance_layers", m[0]), getattr(m, "smooth_layers", m[-1])]
                for m in modifier.mappings
            ]
            raise RecipeError(
                recipe.given_in(),
                f"SmoothQuant cannot smooth {type(meta).__name__} with {which} mappings "
                f"{shown}: {problem}; it would fail after the weights load",
                "give SmoothQuantModifier `mappings` that fit this model ([[balance layers...], "
                "smoothed norm] pairs, e.g. [[['re:.*q_proj$', 're:.*k_proj$', 're:.*v_proj$'], "
                "'re:.*input_layernorm$']]), or drop SmoothQuantModifier (GPTQ alone still "
                "quantizes weights and activations to int8)",
            )


def _resolve_unignored(modifier, meta) -> list:
    """What the mappings resolve to with the ignore list left out."""
    return compat.resolve_smoothquant_mappings(modifier.model_copy(update={"ignore": []}), meta)


def trace_config(
    config,
    sample_input: dict,
    model_class: str = "AutoModelForCausalLM",
    sequential_targets: list[str] | None = None,
    tracing_ignore: list[str] | None = None,
    trust_remote_code: bool = False,
) -> TraceReport:
    """Build `config`'s model with no weights and trace it as the sequential pipeline would.

    `sample_input` holds tensors of shape [1, seq] (input_ids, attention_mask). Raises
    `TraceabilityError` when the targets match nothing or the trace fails.
    """
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.utils.pytorch import infer_sequential_targets

    ignore = list(tracing_ignore) if tracing_ignore is not None else default_tracing_ignore()
    rss_before = _maxrss_mb()
    start = time.perf_counter()

    model = meta_model(config, model_class, trust_remote_code)

    # Same inference as llm-compressor's sequential pipeline: default is _no_split_modules.
    targets = infer_sequential_targets(model, sequential_targets)
    targets = sorted(targets) if isinstance(targets, set) else list(targets)
    layers = {id(module) for _, module in match_named_modules(model, targets)}
    if not layers:
        # llm-compressor accepts targets that match nothing and silently calibrates the whole
        # model as one subgraph: the memory blow-up this pipeline exists to avoid.
        layer_classes = sorted(
            {type(m).__name__ for m in model.modules() if "Layer" in type(m).__name__}
        )
        raise TraceabilityError(
            "recipe.sequential_targets",
            f"{targets} match no module of {type(model).__name__}",
            f"set it to the decoder layer class (candidates: {layer_classes or 'none found'}), "
            "or leave it empty to use the model's default",
        )

    try:
        with compat.restored_torch_functions():
            subgraphs = compat.trace_subgraphs(model, sample_input, targets, ignore)
    except Exception as exc:  # any tracing failure (TraceError, TypeError...) is the user's to fix
        raise _trace_error(exc, targets, ignore) from exc
    # A sample that skips some target layers (e.g. cross-attention without an image) leaves
    # them out of every subgraph: they would get no calibration statistics.
    if len(subgraphs) < len(layers) + 1:
        raise TraceabilityError(
            "recipe.sequential_targets",
            f"the trace of {type(model).__name__} has {len(subgraphs)} subgraphs for "
            f"{len(layers)} layers of {targets}: the calibration sample does not reach every "
            "layer, so some would get no statistics",
            "calibrate with inputs that reach every layer (e.g. dataset.vision_samples for "
            "cross-attention layers), or leave the unreached layers unquantized (recipe ignore)",
        )

    seconds = time.perf_counter() - start
    peak = _maxrss_mb()
    return TraceReport(
        checked=True,
        subgraphs=len(subgraphs),
        seconds=round(seconds, 3),
        reason=f"traced {type(model).__name__} into {len(subgraphs)} subgraphs",
        sequential_targets=targets,
        tracing_ignore=ignore,
        peak_rss_mb=round(peak, 1),
        rss_growth_mb=round(peak - rss_before, 1),
    )


def check_shapes(model: FetchedModel, recipe: RenderedRecipe) -> None:
    """The recipe's group sizes and SmoothQuant mappings fit the model's layers."""
    check_quantized_layers(model, recipe)
    check_smoothquant_mappings(model, recipe)


def meta_vision_modules(model: FetchedModel) -> list[str]:
    """The modules outside the language model, from a meta model of `model`'s config."""
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    return outside_text_model(meta_model(loaded, model.model_class, model.trust_remote_code))
