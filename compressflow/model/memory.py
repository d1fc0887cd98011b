"""The memory plan: where calibration keeps the weights, decided from the config before any load.

Out-of-memory failures hours into a run are what large-model users meet most. Everything that
decides the peak is known before the weights load: the weights' bytes (the checkpoint on disk),
the largest sequential layer and its calibration state (GPTQ keeps an in_features^2 float32
Hessian per module, for every expert of an MoE layer at once), the activations the sequential
pipeline caches between layers (every sample's tokens x hidden, in and out) and one batch's
forward pass. Against what the worker has (free CPU memory or the user's cap; a share of the free
GPU memory, GPU_SHARE, or the user's cap) the plan picks, in order of speed:

- `model_free`: a data-free scheme quantized shard by shard by llm-compressor's `model_free_ptq`,
  without building the model: about one shard in memory, whatever the model's size (verify then
  runs the base and the compressed model for its logits check with every weight read from disk);
- `gpu`/`cpu`: weights in CPU memory, each layer computed on the GPU when there is one;
- `disk`: weights read from the checkpoint layer by layer (compressed-tensors' disk offload), so
  only a layer, its state and the cached activations need memory.

On a GPU, the automatic batch is the largest that fits the GPU's budget; the notes say what it
costs over batch 1 and which limit bound it. What fits nowhere is refused with the numbers and
what to change. Estimates err high: a plan that says it fits should not meet an out-of-memory
error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from compressflow import compat
from compressflow.errors import InputError, ResourceError
from compressflow.model.headers import tensor_index
from compressflow.model.offload import offload_folder
from compressflow.params import GPU_SHARE, CalibrationArgs
from compressflow.results import (
    BuiltDataset,
    FetchedModel,
    MemoryPlan,
    RenderedRecipe,
    gib,
    gpu_limit,
)

GIB = 2**30
# Two interpreters with torch and transformers imported: the task's (with Prefect, ~0.6 GiB) and
# calibration's own (~0.5 GiB), measured before any weights load; the rest is headroom for what
# the plan's terms leave out (a 3.7 GB model calibrated from disk under a 2.3 GiB cap peaked 5%
# above the cap with 1.5 GiB here).
CPU_RESERVE = int(2.0 * GIB)
GPU_RESERVE = int(1.0 * GIB)  # CUDA context and kernels
AUTO_BATCH_SIZES = (16, 8, 4, 2, 1)
# llm-compressor cuts each batch to its shortest sample (padding instead would calibrate GPTQ on
# pad tokens): an automatic batch size may drop at most this share of the calibration tokens.
MAX_TRUNCATED_SHARE = 0.02
HESSIAN_MODIFIERS = {"GPTQModifier", "SparseGPTModifier"}
# What takes one sample per calibration batch, and why (llm-compressor 0.14, auto-round 0.14).
ONE_SAMPLE_MODIFIERS = {
    "AutoRoundModifier": "AutoRoundModifier batches the samples it captures itself (its own "
    "batch_size) and takes one per calibration batch; given more, auto-round exits the process",
}
# Measured on 2 CPU cores (docs/benchmarks/memory-plan.md): oneshot took as long with batch 16
# as with 1, and held about 0.5 GB more; batching pays on a GPU.
CPU_BATCH = (
    "computed on CPU, where larger batches do not speed calibration and hold more memory (set "
    "calibration.batch_size to batch anyway)"
)
ONE_SAMPLE_IMAGES = "image+text calibration runs one sample per batch (images differ in shape)"
# model_free_ptq reads a shard, quantizes it tensor by tensor and writes it: the shard, its
# quantized copy and one tensor's float32 working copy.
SHARD_FACTOR = 3
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class Shape:
    """What the plan needs from the model's config, read on the meta device."""

    parameters: int
    hidden: int
    intermediate: int
    heads: int
    largest_layer: int  # parameters of the largest sequential layer
    largest_state: int  # Hessian elements of that layer (float32)
    largest_module: int  # the largest layer's largest Linear weight (GPTQ works on a float32 copy)
    quantizable: frozenset[str]  # modules whose 2-D weight is an nn.Linear's
    not_linear: frozenset[str]  # modules with a 2-D weight that is not (embeddings, ...)


def model_shape(meta, config, layer_classes: list[str]) -> Shape:
    """Sizes from a model built on the meta device (see compressflow.model.tracing.meta_model)."""
    import torch

    text = config.get_text_config()  # vision-language configs nest the language model's
    hidden = getattr(text, "hidden_size", 0) or 0
    layers = [m for m in meta.modules() if type(m).__name__ in layer_classes] or [meta]

    def state(layer) -> int:
        elements = 0
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                elements += module.in_features**2
        for name, param in layer.named_parameters():
            if param.dim() == 3:  # fused experts (experts, out, in): one Hessian per expert
                per_expert = 2 if "gate_up" in name else 1
                elements += param.shape[0] * param.shape[-1] ** 2 * per_expert
        return elements

    largest = max(layers, key=lambda layer: sum(p.numel() for p in layer.parameters()))
    linear = {name for name, m in meta.named_modules() if isinstance(m, torch.nn.Linear)}
    two_d = {
        name.rsplit(".", 1)[0]
        for name, p in meta.named_parameters()
        if p.dim() == 2 and name.endswith(".weight")
    }
    return Shape(
        parameters=sum(p.numel() for p in meta.parameters()),
        hidden=hidden,
        intermediate=getattr(text, "intermediate_size", 0) or 4 * hidden,
        heads=getattr(text, "num_attention_heads", 0) or 1,
        largest_layer=sum(p.numel() for p in largest.parameters()),
        largest_state=max(state(layer) for layer in layers),
        # The Linear GPTQ quantizes, not the embedding (Llama-3 8B's is 4x larger than any).
        largest_module=max(
            (m.weight.numel() for m in largest.modules() if isinstance(m, torch.nn.Linear)),
            default=0,
        ),
        quantizable=frozenset(linear),
        not_linear=frozenset(two_d - linear),
    )


def available_cpu_bytes() -> int:
    """MemAvailable, lowered to the cgroup's limit when the worker runs in a container."""
    available = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):  # no cgroup v2 memory controller: MemAvailable stands
        pass
    return available


def available_gpu_bytes() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    return torch.cuda.mem_get_info()[0]


def model_free_spec(recipe: RenderedRecipe) -> tuple[str | None, list[str], str]:
    """(scheme, ignore, why-not): a scheme only when model_free_ptq can run this recipe as is.

    That is one QuantizationModifier with a preset FP8-weight scheme whose activations are dynamic
    (nothing to calibrate) and no KV-cache scheme; anything else needs the model built.
    """
    if recipe.needs_data:
        return None, [], "the recipe calibrates on data"
    modifiers = []
    for stage in (yaml.safe_load(recipe.yaml) or {}).values():
        for group in (stage or {}).values():
            if isinstance(group, dict):
                modifiers.extend(group.items())
    if len(modifiers) != 1 or modifiers[0][0] != "QuantizationModifier":
        return None, [], "model_free runs a single QuantizationModifier only"
    options = modifiers[0][1] or {}
    scheme = options.get("scheme")
    if (
        not isinstance(scheme, str)
        or options.get("config_groups")
        or options.get("kv_cache_scheme")
    ):
        return None, [], "model_free needs a preset scheme name and no KV-cache scheme"
    targets = options.get("targets", ["Linear"])
    if targets not in ("Linear", ["Linear"]):
        return None, [], "model_free matches Linear targets only"
    from compressed_tensors.quantization import preset_name_to_scheme

    try:
        preset = preset_name_to_scheme(scheme, [])
    except (KeyError, ValueError):
        return None, [], f"{scheme} is not a preset scheme"
    if preset.input_activations is not None and not preset.input_activations.dynamic:
        return None, [], f"{scheme} calibrates activations"
    weights = preset.weights
    if weights is None or weights.type != "float" or weights.num_bits != 8:
        # Measured: int8 (W8A8) written by model_free_ptq does not reload in transformers, and
        # verify checks FP8 weights only, weight by weight; the classic path runs the rest.
        return None, [], f"{scheme}: model_free runs FP8 weights only"
    ignore = options.get("ignore") or []
    return scheme, [ignore] if isinstance(ignore, str) else list(ignore), ""


def checkpoint_modules(folder: Path) -> tuple[set[str], set[str], int]:
    """From the safetensors headers: modules with a 2-D `.weight`, modules with any other
    `.weight`, and the largest shard's bytes."""
    two_d: set[str] = set()
    other: set[str] = set()
    index = tensor_index(folder)
    for name, info in index.items():
        if name.endswith(".weight"):
            (two_d if len(info.shape) == 2 else other).add(name.rsplit(".", 1)[0])
    largest = max((file.stat().st_size for file in {i.file for i in index.values()}), default=0)
    return two_d, other, largest


def model_free_ignore(folder: Path, shape: Shape, ignore: list[str]) -> tuple[list[str], str]:
    """The ignore list model_free_ptq needs, or why the checkpoint's names rule it out.

    model_free_ptq quantizes every `.weight` it is not told to ignore, except modules whose name
    ends in "norm": it sees names, not classes. So embeddings and norms named otherwise (Falcon's
    `ln_f`) must be listed. The meta model knows the classes; it can only vouch for names it
    has, so a checkpoint saved under other names (a vision-language model, fused experts) is not
    sent down this path.
    """
    two_d, other, _ = checkpoint_modules(folder)
    unknown = two_d - shape.quantizable - shape.not_linear
    if unknown:
        return [], f"checkpoint names differ from the model's, e.g. {sorted(unknown)[0]}"
    unnamed_norms = {module for module in other if not module.endswith("norm")}
    return sorted(set(ignore) | (two_d & shape.not_linear) | unnamed_norms), ""


def truncated_share(lengths: list[int], batch: int) -> float:
    """Share of tokens lost when samples, longest first, are batched and cut to each batch's
    shortest (llm-compressor's LengthAwareSampler with its truncating collator)."""
    ordered = sorted(lengths, reverse=True)
    kept = sum(
        min(ordered[i : i + batch]) * len(ordered[i : i + batch])
        for i in range(0, len(ordered), batch)
    )
    return 1 - kept / max(sum(ordered), 1)


def sample_lengths(dataset: BuiltDataset | None) -> list[int]:
    """Tokens per calibration sample, from the built dataset; empty when there is none."""
    if dataset is None or not Path(dataset.path).exists():
        return []
    from datasets import load_from_disk

    return [len(ids) for ids in load_from_disk(dataset.path)["input_ids"]]


def has_images(dataset: BuiltDataset | None) -> bool:
    """Whether the built dataset holds image+text rows (calibrate batches those one by one)."""
    if dataset is None or not Path(dataset.path).exists():
        return False
    from datasets import load_from_disk

    return "pixel_values" in load_from_disk(dataset.path).column_names


def weight_bytes(model: FetchedModel, config, parameters: int) -> tuple[int, float]:
    """Bytes of the weights as loaded, and bytes per parameter.

    The checkpoint's size when its weights are here; from the config's dtype when they are not
    (validation fetches a hub model without its weights).
    """
    folder = Path(model.path)
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")):
        return model.size_bytes, model.size_bytes / max(parameters, 1)
    dtype = str(
        getattr(config.get_text_config(), "dtype", None) or getattr(config, "dtype", "bfloat16")
    )
    per = DTYPE_BYTES.get(dtype.replace("torch.", ""), 2)
    return parameters * per, per


def capped(cap_gb: float, available: int, field: str, free: str, notes: list[str]) -> int:
    """What the plan may fill: `available`, or the user's cap (`field`) where that is less."""
    if not cap_gb:
        return available
    cap = int(cap_gb * GIB)
    if cap > available:
        notes.append(f"{field} ({gib(cap)}) is above {free}: the plan keeps to {gib(available)}")
    return min(cap, available)


def make_plan(
    model: FetchedModel,
    recipe: RenderedRecipe,
    dataset: BuiltDataset | None,
    args: CalibrationArgs,
    shape: Shape,
    config,
    target: Path,
    cpu_available: int,
    gpu_available: int,
    lengths: list[int] | None = None,
    images: bool = False,
) -> MemoryPlan:
    """The plan for this run on this worker; ResourceError when it fits nowhere.

    `lengths` (tokens per sample) bound the automatic batch size by what truncation would drop;
    `images` (image+text rows) and a one-sample algorithm (AutoRound) make it 1.
    """
    notes: list[str] = []
    weights, per_param = weight_bytes(model, config, shape.parameters)
    act = max(per_param, 2)  # activations in the model's dtype (float32 models: 4)
    cpu_budget = capped(
        args.max_cpu_memory_gb,
        cpu_available,
        "calibration.max_cpu_memory_gb",
        f"what the worker has free ({gib(cpu_available)})",
        notes,
    )
    gpu_of_free = int(GPU_SHARE * gpu_available)
    gpu_budget = capped(
        args.max_gpu_memory_gb if gpu_available else 0,
        gpu_of_free,
        "calibration.max_gpu_memory_gb",
        f"{GPU_SHARE:.0%} of the {gib(gpu_available)} free",
        notes,
    )
    if args.max_gpu_memory_gb and not gpu_available:
        # Not refused: one deployment's parameters run on every worker of its pool, and a cap
        # on a GPU's memory is met where there is none.
        notes.append(
            "calibration.max_gpu_memory_gb does not apply: this worker has no GPU, so "
            "calibration computes on CPU"
        )
    gpu_capped = gpu_budget < gpu_of_free  # the user's cap, not the share, bounds the GPU
    limit = gpu_limit(gpu_budget, gpu_available, GPU_SHARE, gpu_capped)
    common = dict(
        weight_bytes=weights,
        largest_layer_bytes=int(shape.largest_layer * per_param),
        cpu_available_bytes=cpu_budget,
        gpu_available_bytes=gpu_available,
        gpu_budget_bytes=gpu_budget,
        gpu_share=GPU_SHARE if gpu_available else 0,
        gpu_capped=gpu_capped,
        sequential_offload_device=args.sequential_offload_device,
        moe_calibrate_all_experts=args.moe_calibrate_all_experts,
    )
    device = "cuda" if gpu_available else "cpu"

    scheme, ignore, why_not = model_free_spec(recipe)
    if scheme and model.path and Path(model.path, "config.json").exists():
        ignore, why_not = model_free_ignore(Path(model.path), shape, ignore)
        if why_not:
            scheme = None
    if args.path == "model_free" and not scheme:
        raise ResourceError(
            "calibration.path",
            f"the model-free path cannot run this recipe: {why_not}",
            "set calibration.path to auto or classic",
        )
    if scheme and args.path != "classic":
        _, _, shard = checkpoint_modules(Path(model.path))
        needed = CPU_RESERVE + SHARD_FACTOR * shard
        on_gpu = GPU_RESERVE + SHARD_FACTOR * shard
        if gpu_available and on_gpu > gpu_budget:
            notes.append(
                f"model_free computes on cpu: {gib(on_gpu)} (the CUDA context and "
                f"{SHARD_FACTOR} x the largest shard) is over {limit}"
            )
            device, on_gpu = "cpu", 0
        if needed > cpu_budget and device == "cpu":
            raise ResourceError(
                "calibration.max_cpu_memory_gb",
                f"quantizing {model.model_id} shard by shard needs {gib(needed)} of CPU memory "
                f"(its largest shard is {gib(shard)}), but the plan may use {gib(cpu_budget)}",
                "raise calibration.max_cpu_memory_gb, free memory on the worker, or re-shard "
                "the checkpoint into smaller files",
            )
        notes.append(f"model_free: {scheme} needs no data; ignoring {', '.join(ignore) or 'none'}")
        plan = MemoryPlan(
            path="model_free",
            placement="shards",
            device=device,
            state_bytes=0,
            activation_bytes=0,
            batch_bytes=0,
            largest_shard_bytes=shard,
            cpu_needed_bytes=needed,
            gpu_needed_bytes=on_gpu if device == "cuda" else 0,
            batch_size=1,
            sequential_prefetch=False,
            weights_in_memory_bytes=0,
            offload_folder=offload_folder(args, target),
            model_free_scheme=scheme,
            model_free_ignore=ignore,
            notes=notes,
            **common,
        )
        return with_gpu_cost(plan)
    if args.path == "auto" and why_not and not recipe.needs_data:
        notes.append(f"classic path: {why_not}")

    tokens = int(dataset.token_stats.get("total", 0)) if dataset else 0
    longest = int(dataset.token_stats.get("max", 0)) if dataset else 0
    samples = dataset.num_samples if dataset else 0
    hessians = recipe.needs_data and bool(HESSIAN_MODIFIERS & set(recipe.modifiers))
    state = (shape.largest_state * 4 + 2 * shape.largest_module * 4) if hessians else 0
    activations = int(2 * tokens * shape.hidden * act)
    layer = common["largest_layer_bytes"]

    def batch_bytes(batch: int) -> int:
        if not samples:
            return 0
        width = 3 * shape.intermediate + 6 * shape.hidden
        return int(batch * longest * width * act + batch * shape.heads * longest**2 * 4)

    in_flight = 2 if gpu_available and args.sequential_prefetch != "off" else 1  # prefetch
    cached_on_gpu = args.sequential_offload_device == "cuda" and bool(gpu_available)

    def needs(batch: int, placement: str) -> tuple[int, int]:
        """(CPU, GPU) bytes for `batch` with the weights on `placement`."""
        on_device = state + batch_bytes(batch) * in_flight
        cpu = CPU_RESERVE + (0 if cached_on_gpu else activations)
        cpu += weights if placement in ("cpu", "gpu") else 2 * layer
        if gpu_available:
            gpu = GPU_RESERVE + layer + on_device + (activations if cached_on_gpu else 0)
            return int(cpu), int(gpu)
        return int(cpu + on_device), 0

    one_sample = [why for name, why in ONE_SAMPLE_MODIFIERS.items() if name in recipe.modifiers]
    one_sample += [ONE_SAMPLE_IMAGES] if images else []
    if one_sample and args.batch_size > 1:
        raise InputError(
            "calibration.batch_size",
            f"batch_size={args.batch_size} cannot run: {'; '.join(one_sample)}",
            "set calibration.batch_size to 0 (automatic, which picks 1 here) or 1",
        )
    if one_sample:
        notes.append(f"batch 1: {'; '.join(one_sample)}")
        sizes = [1]
    elif not args.batch_size and not gpu_available:
        notes.append(f"batch 1: {CPU_BATCH}")
        sizes = [1]
    else:
        sizes = [args.batch_size] if args.batch_size else list(AUTO_BATCH_SIZES)
    if samples:
        sizes = [b for b in sizes if b <= samples] or [1]
    if lengths and not args.batch_size:
        sizes = [b for b in sizes if truncated_share(lengths, b) <= MAX_TRUNCATED_SHARE] or [1]
    if lengths and (share := truncated_share(lengths, sizes[0])) > 0:
        notes.append(f"batch {sizes[0]} cuts {share:.1%} of the calibration tokens (truncation)")
    placements = ["gpu" if gpu_available else "cpu", "disk"]
    for placement in placements:
        for batch in sizes:
            cpu, gpu = needs(batch, placement)
            if cpu <= cpu_budget and gpu <= gpu_budget:
                larger = sizes[max(sizes.index(batch) - 1, 0)]
                larger_gpu = needs(larger, placement)[1]
                if gpu_available and larger > batch and larger_gpu > gpu_budget:
                    notes.append(
                        f"batch {larger} would need {gib(larger_gpu)} of GPU memory, over {limit}"
                    )
                if placement == "disk":
                    notes.append(
                        f"the weights ({gib(weights)}) do not fit in {gib(cpu_budget)} of CPU "
                        "memory with the rest: they are read from disk layer by layer"
                    )
                prefetch = {"on": True, "off": False}.get(
                    args.sequential_prefetch, bool(gpu_available)
                )
                plan = MemoryPlan(
                    path="classic",
                    placement=placement,
                    device=device,
                    state_bytes=state,
                    activation_bytes=activations,
                    batch_bytes=batch_bytes(batch),
                    cpu_needed_bytes=cpu,
                    gpu_needed_bytes=gpu,
                    gpu_batch_one_bytes=needs(1, placement)[1],
                    batch_size=batch,
                    sequential_prefetch=prefetch and gpu_available > 0,
                    weights_in_memory_bytes=weights if placement != "disk" else cpu_budget - cpu,
                    offload_folder=offload_folder(args, target) if placement == "disk" else None,
                    notes=notes,
                    **common,
                )
                return with_gpu_cost(plan)
    cpu, gpu = needs(sizes[-1], "disk")
    if cpu <= cpu_budget:  # CPU memory holds it with the weights on disk: the GPU cannot
        fixes = [
            f"raise calibration.max_gpu_memory_gb to {math.ceil(gpu / GIB * 10) / 10:g} or more"
            if gpu_capped and gpu <= gpu_of_free
            else f"run where the GPU has {gib(gpu / GPU_SHARE)} free or more"
        ]
        if sizes[-1] > 1:
            fixes.append("set calibration.batch_size lower, or to 0 (the largest that fits)")
        if cached_on_gpu:
            fixes.append(
                "set calibration.sequential_offload_device to cpu (the cached activations, "
                f"{gib(activations)}, then wait in CPU memory)"
            )
        if in_flight > 1:
            fixes.append(
                "set calibration.sequential_prefetch to off (one batch on the GPU, not two)"
            )
        fixes.append("lower dataset.max_seq_len (a batch grows with its longest sample)")
        raise ResourceError(
            "calibration.max_gpu_memory_gb"
            if gpu_capped
            else ("calibration.batch_size" if sizes[-1] > 1 else "dataset.max_seq_len"),
            f"calibrating {model.model_id} at batch {sizes[-1]} needs {gib(gpu)} of GPU memory "
            f"(CUDA context {gib(GPU_RESERVE)}, largest layer {gib(layer)}, calibration state "
            f"{gib(state)}, {in_flight} batch(es) in flight "
            f"{gib(in_flight * batch_bytes(sizes[-1]))}"
            + (f", cached activations {gib(activations)}" if cached_on_gpu else "")
            + f"), but the plan may fill {limit}",
            "; or ".join(fixes),
        )
    where = (
        f"{gib(gpu)} of GPU memory (the plan may fill {gib(gpu_budget)}) and "
        if gpu_available
        else ""
    )
    raise ResourceError(
        "calibration.max_cpu_memory_gb" if args.max_cpu_memory_gb else "dataset.text_samples",
        f"calibrating {model.model_id} needs {where}{gib(cpu)} of CPU memory even with its "
        f"weights on disk (largest layer {gib(layer)}, calibration state {gib(state)}, "
        f"cached activations {gib(activations)} for {tokens} tokens, one batch of "
        f"{sizes[-1]} {gib(batch_bytes(sizes[-1]))}), but the plan may use {gib(cpu_budget)}",
        "fewer calibration tokens (dataset.text_samples, dataset.max_seq_len) shrink the cached "
        "activations; a smaller calibration.batch_size shrinks the batch; or run on a worker with "
        "more memory"
        + (", or raise calibration.max_cpu_memory_gb" if args.max_cpu_memory_gb else ""),
    )


def with_gpu_cost(plan: MemoryPlan) -> MemoryPlan:
    """The plan with a note of its GPU peak against batch 1's and the limit it keeps to."""
    cost = plan.gpu_cost()
    return plan.model_copy(update={"notes": [*plan.notes, cost]}) if cost else plan


def plan_for(
    model: FetchedModel,
    recipe: RenderedRecipe,
    dataset: BuiltDataset | None,
    args: CalibrationArgs,
    target: Path,
    layer_classes: list[str] | None = None,
) -> MemoryPlan:
    """Read the config, build the model on the meta device, measure the worker, plan."""
    from transformers import AutoConfig

    from compressflow.model.tracing import meta_model

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    meta = meta_model(config, model.model_class, model.trust_remote_code)
    classes = layer_classes or recipe.sequential_targets or compat.no_split_modules(meta)
    shape = model_shape(meta, config, classes)
    return make_plan(
        model,
        recipe,
        dataset,
        args,
        shape,
        config,
        target,
        available_cpu_bytes(),
        available_gpu_bytes(),
        sample_lengths(dataset),
        has_images(dataset),
    )
