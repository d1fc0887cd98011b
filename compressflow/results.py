"""What stages return: small typed results the flow passes forward, and workers pickle.

They live in an installed module with a stable name (not in a flow file a worker loads by path),
so a result pickled by one process unpickles in another (a sweep reading a compress run's result).
A stage takes the results it needs as arguments and never imports another stage to get a type.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from compressflow.params import METRICS

# fetch model


class FetchedModel(BaseModel):
    """A model on local disk, and what it is, independent of where it came from."""

    path: str = Field(description="Local folder with config, tokenizer and weights.")
    source: Literal["local", "hub", "clearml"]
    model_id: str
    revision_requested: str | None = None
    revision_resolved: str | None = Field(default=None, description="Hub commit sha.")
    identity: str = Field(
        description="Immutable identity: 'hub:<id>@<sha>', 'clearml:<id>:<hash>' or 'sha256:<hash>'."
    )
    size_bytes: int
    parameters: int | None = Field(default=None, description="From safetensors headers.")
    trust_remote_code: bool = False
    model_class: str = "AutoModelForCausalLM"
    files: dict[str, str] = Field(
        default_factory=dict,
        exclude=True,  # a run's own record, not the model's: kept out of manifests and logs
        description="Each file of the folder -> its size, times and inode, taken before it was "
        "hashed or read: publish refuses when one changed since (the source was written while "
        "the run read it; store.identity.changed_since).",
    )

    def exists(self) -> bool:
        return Path(self.path, "config.json").exists()

    def log_to(self, tracker) -> None:
        tracker.params("model", self.tracking_params())

    def tracking_params(self) -> dict:
        return {
            "model_id": self.model_id,
            "source": self.source,
            "revision_requested": self.revision_requested or "",
            "revision_resolved": self.revision_resolved or "",
            "identity": self.identity,
            "size_bytes": self.size_bytes,
            "parameters": self.parameters or 0,
            "model_class": self.model_class,
        }


# build dataset


class BuiltDataset(BaseModel):
    path: str = Field(description="datasets.save_to_disk folder with input_ids and attention_mask.")
    fingerprint: str = Field(
        description="sha256 over the tokenized samples and how they were made."
    )
    source: str = Field(description="Where the rows came from, e.g. 'shortcut:python_docs'.")
    num_samples: int
    token_stats: dict[str, float] = Field(description="min, mean, max and total tokens per sample.")
    chat_template_applied: bool = False

    def exists(self) -> bool:
        return Path(self.path, "dataset_info.json").exists()

    def log_to(self, tracker) -> None:
        tracker.params("dataset", self.tracking_params())

    def tracking_params(self) -> dict:
        return {
            "source": self.source,
            "fingerprint": self.fingerprint,
            "samples": self.num_samples,
            "chat_template_applied": self.chat_template_applied,
            **{f"tokens_{name}": value for name, value in self.token_stats.items()},
        }


class HeldOutText(BaseModel):
    source: str
    input_ids: list[list[int]] = Field(description="One tokenized sample per entry, unpadded.")
    excluded_calibration_samples: int = Field(
        description="Rows left out because the compressed model was calibrated on them."
    )


# render recipe


class RenderedRecipe(BaseModel):
    yaml: str = Field(description="The rendered recipe: what oneshot gets and recipe.yaml holds.")
    sha256: str = Field(description="Hash of `yaml`.")
    source: str = Field(description="'preset:W4A16', 'yaml', 'file:<path>', 'dict' or 'list'.")
    modifiers: list[str] = Field(description="Modifier class names, in order.")
    scheme: str | None = Field(default=None, description="Quantization scheme, e.g. W4A16.")
    pipeline: str = Field(description="Effective calibration pipeline for the data modifiers.")
    needs_data: bool = Field(description="Whether any modifier needs calibration data.")
    data_modifiers: int = Field(
        default=0, description="How many modifiers need calibration data (sequential passes)."
    )
    notes: list[str] = Field(
        default_factory=list,
        description="Changes made to what was asked: migrations (e.g. legacy observer) and "
        "architecture rules.",
    )
    architecture: str | None = Field(
        default=None, description="The model's model_type, once adapted to it."
    )
    sequential_targets: list[str] | None = Field(
        default=None,
        description="Layer classes the sequential pipeline calibrates one at a time, when the "
        "architecture needs other than llm-compressor's default (recipe.sequential_targets wins).",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Values the $placeholders took, preset defaults included.",
    )
    kv_cache_scheme: dict[str, Any] | None = Field(
        default=None,
        description="The KV-cache quantization the modifiers ask for (num_bits, type, strategy, "
        "dynamic, symmetric); None when keys and values stay in the model's dtype.",
    )

    def given_in(self) -> str:
        """The parameter the user chose the recipe with: what an error about it names."""
        return "recipe.preset" if self.source.startswith("preset:") else "recipe.recipe"

    def log_to(self, tracker) -> None:
        tracker.configuration("recipe", self.yaml, description=f"Rendered from {self.source}")
        tracker.params("recipe_args", self.args)
        if self.notes:
            tracker.params("recipe_notes", dict(enumerate(self.notes)))


# check traceability


class TraceReport(BaseModel):
    checked: bool
    subgraphs: int | None = None
    seconds: float = 0.0
    reason: str = ""
    sequential_targets: list[str] = Field(
        default_factory=list, description="Module class names the model was partitioned at."
    )
    tracing_ignore: list[str] = Field(
        default_factory=list, description="Function names the tracer skipped."
    )
    peak_rss_mb: float | None = Field(
        default=None,
        description="Process peak resident memory after tracing (getrusage ru_maxrss). It "
        "includes the imports and anything the process did before; it is per config only in a "
        "fresh process, which is how the benchmark measures it.",
    )
    rss_growth_mb: float | None = Field(
        default=None,
        description="How much tracing raised that peak: 0 when an earlier step peaked higher.",
    )


# plan memory


def gib(size: float) -> str:
    """Bytes in GiB, or MiB below one GiB (so small figures do not read 0.00)."""
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def gpu_limit(budget: int, free: int, share: float, capped: bool) -> str:
    """The GPU memory the plan may fill, in words: the user's cap, or its share of the free."""
    of_free = f"{share:.0%} of the {gib(free)} free"
    if capped:
        return f"the {gib(budget)} cap (calibration.max_gpu_memory_gb, below {of_free})"
    return of_free


class MemoryPlan(BaseModel):
    """Where calibration keeps the weights and what it expects to need, from the config alone."""

    path: Literal["classic", "model_free"] = Field(
        description="classic: load the model and run oneshot; model_free: quantize shard by shard."
    )
    placement: Literal["gpu", "cpu", "disk", "shards"] = Field(
        description="Where the weights live while calibrating: on the GPU, in CPU memory, read "
        "from disk layer by layer, or one shard at a time (model_free)."
    )
    device: str = Field(description="Where each layer is computed: cuda or cpu.")
    weight_bytes: int = Field(description="The model's weights as loaded.")
    largest_layer_bytes: int = Field(description="The largest sequential layer's weights.")
    state_bytes: int = Field(
        description="The largest layer's calibration state (GPTQ Hessians: in_features^2 float32 "
        "per module, every expert of an MoE layer at once)."
    )
    activation_bytes: int = Field(
        description="Activations cached between layers: samples x tokens x hidden, in and out."
    )
    batch_bytes: int = Field(description="Working memory of one forward pass of one batch.")
    largest_shard_bytes: int = Field(default=0, description="The largest safetensors shard.")
    cpu_needed_bytes: int = Field(description="Planned peak CPU memory.")
    cpu_available_bytes: int = Field(description="CPU memory the plan may use (cap or available).")
    gpu_needed_bytes: int = Field(default=0, description="Planned peak GPU memory.")
    gpu_available_bytes: int = Field(default=0, description="Free GPU memory; 0 without a GPU.")
    gpu_budget_bytes: int = Field(
        default=0,
        description="GPU memory the plan may fill: its share of the free memory (gpu_share), or "
        "calibration.max_gpu_memory_gb where that is less; 0 without a GPU.",
    )
    gpu_share: float = Field(default=0, description="The share of free GPU memory the plan fills.")
    gpu_capped: bool = Field(
        default=False,
        description="Whether calibration.max_gpu_memory_gb, not the share, set the GPU budget.",
    )
    gpu_batch_one_bytes: int = Field(
        default=0,
        description="Planned peak GPU memory at batch 1: what the chosen batch costs over it.",
    )
    batch_size: int
    sequential_prefetch: bool
    sequential_offload_device: str
    moe_calibrate_all_experts: bool
    offload_folder: str | None = Field(
        default=None, description="Folder for weights offloaded to disk (placement disk)."
    )
    model_free_scheme: str | None = Field(
        default=None, description="The scheme model_free_ptq applies (path model_free)."
    )
    model_free_ignore: list[str] = Field(
        default_factory=list,
        description="Modules model_free_ptq leaves alone: the recipe's ignore list and every 2-D "
        "weight that is not a Linear's (embeddings), which it cannot tell apart by name.",
    )
    weights_in_memory_bytes: int = Field(
        description="How much of the weights may stay in CPU memory; the rest is read from disk "
        "module by module when used (placement disk and shards)."
    )
    checkpoint_folder: str = Field(
        default="",
        description="Where calibration checkpoints go (one subfolder per recipe); empty: none.",
    )
    checkpoint_interval_s: float = Field(
        default=-1, description="Seconds between calibration checkpoints; negative: none."
    )
    checkpoint_bytes: int = Field(
        default=0,
        description="Disk the calibration checkpoint may take: the weights once per sequential "
        "pass, plus the activations between layers.",
    )
    threads: int = Field(
        default=0,
        description="CPU threads calibration starts with (0: not planned); an automatic count "
        "follows the computing processes on the host while it runs (a note says why).",
    )
    notes: list[str] = Field(default_factory=list, description="Why the plan chose what it did.")

    def summary(self) -> str:
        human = gib
        if self.path == "model_free":
            return (
                f"model_free path: {self.model_free_scheme} shard by shard on {self.device}, no "
                f"model built: largest shard {human(self.largest_shard_bytes)}; CPU "
                f"{human(self.cpu_needed_bytes)} of {human(self.cpu_available_bytes)}"
            )
        gpu = (
            f", GPU {human(self.gpu_needed_bytes)} of {human(self.gpu_budget_bytes)}"
            if self.gpu_available_bytes
            else ""
        )
        return (
            f"{self.path} path, weights on {self.placement}, computed on {self.device}: "
            f"weights {human(self.weight_bytes)}, largest layer {human(self.largest_layer_bytes)}, "
            f"calibration state {human(self.state_bytes)}, cached activations "
            f"{human(self.activation_bytes)}; CPU {human(self.cpu_needed_bytes)} of "
            f"{human(self.cpu_available_bytes)}{gpu}; batch {self.batch_size}"
            + (
                f"; checkpoints every {self.checkpoint_interval_s:g} s, up to "
                f"{human(self.checkpoint_bytes)} of disk"
                if self.checkpoint_folder
                else "; no checkpoints"
            )
        )

    def gpu_cost(self) -> str:
        """The planned GPU peak against batch 1's and what kept it there; empty without a GPU."""
        if self.device != "cuda":
            return ""
        what = "shard by shard" if self.path == "model_free" else f"batch {self.batch_size}"
        extra = self.gpu_needed_bytes - self.gpu_batch_one_bytes
        more = self.path == "classic" and self.batch_size > 1
        limit = gpu_limit(
            self.gpu_budget_bytes, self.gpu_available_bytes, self.gpu_share, self.gpu_capped
        )
        return (
            f"{what}: {gib(self.gpu_needed_bytes)} planned GPU peak"
            + (f", +{gib(extra)} over batch 1" if more else "")
            + f", within {limit}"
        )

    def log_to(self, tracker) -> None:
        tracker.params("memory plan", self.model_dump(exclude={"notes"}))


# calibrate


class ModuleMetric(BaseModel):
    name: str
    error: float | None = None
    seconds: float | None = None


class LayerTime(BaseModel):
    """One subgraph (decoder layer) of the sequential pipeline: what every algorithm reports."""

    calibration_pass: int = Field(description="1-based; W8A8 makes one pass per data modifier.")
    layer: int = Field(description="0-based subgraph index; 0 holds the embeddings.")
    seconds: float = Field(description="Calibration and compression of this subgraph.")


class Calibration(BaseModel):
    staging_path: str = Field(description="Folder holding the saved checkpoint, not yet published.")
    seconds: float
    peak_rss_mb: float = Field(description="Peak resident memory of the process so far.")
    peak_gpu_mb: float | None = Field(default=None, description="Peak CUDA memory, when on GPU.")
    checkpoint_bytes: int
    modules: list[ModuleMetric] = Field(
        default_factory=list, description="GPTQ's per-module loss and time (GPTQ only)."
    )
    layers: list[LayerTime] = Field(
        default_factory=list, description="Seconds per subgraph, for every algorithm."
    )
    reference_seconds: float | None = Field(
        default=None,
        description="Time spent capturing the base model's reference logits; None on the "
        "model-free path, whose verify pass takes them.",
    )
    reference_path: str | None = Field(
        default=None,
        description="The base model's logits on the verification texts, captured before "
        "calibration changed the model (a file beside the staging folder, never published); "
        "None on the model-free path, which leaves the source as it is.",
    )
    resumed_from: str | None = Field(
        default=None,
        description="Where this calibration resumed from a crashed run's checkpoint ('pass 1, "
        "layer 3 of 9'); None: it ran from the start.",
    )


# search target


class ModuleSensitivity(BaseModel):
    name: str
    weights: int = Field(description="Parameters in the module's weight.")
    in_features: int
    cost: dict[str, float] = Field(
        description="Per precision: estimated rise of the held-out mean log-likelihood (the log "
        "of the perplexity ratio) when this module alone is rounded to it."
    )


class Sensitivity(BaseModel):
    """What each quantizable module costs at each precision of a family, measured once
    (compressflow/reporting/sensitivity.py)."""

    family: str
    base_perplexity: float = Field(description="The base model's held-out perplexity.")
    positions: int = Field(description="Held-out next-token positions measured.")
    seconds: float
    modules: list[ModuleSensitivity]


class MixPoint(BaseModel):
    """One point of the size vs quality trade-off a budget was chosen from."""

    label: str
    avg_bits: float = Field(description="Bits per quantizable weight, scales included.")
    perplexity: float
    measured: bool = Field(
        description="True: calibrated and measured; False: predicted from the sensitivities "
        "(round-to-nearest, which calibration improves on)."
    )


class MixedPrecision(BaseModel):
    """What a mixed-precision budget chose, and the trade-off it chose from."""

    family: str
    precisions: dict[str, str] = Field(description="Module -> precision, as published.")
    avg_bits: float = Field(description="Of the published mix: bits per quantizable weight.")
    sensitivity_seconds: float
    points: list[MixPoint]
    sensitivity: list[ModuleSensitivity] = Field(
        default_factory=list,
        description="Each module's measured cost at each precision: what the mix was chosen from.",
    )


class TargetRound(BaseModel):
    """One calibration of a compress-to-target search, measured on the held-out text."""

    round: int = Field(description="1-based; round 1 is the recipe as asked.")
    unquantized: list[str] = Field(
        description="Modules left out of quantization this round (largest round-1 error first)."
    )
    perplexity: float = Field(description="Held-out perplexity of this round's output.")
    ratio: float = Field(description="perplexity / the base model's perplexity.")
    size_bytes: int = Field(description="This round's checkpoint on disk.")
    met: bool = Field(description="ratio <= the target.")
    avg_bits: float | None = Field(
        default=None, description="A mixed-precision round's bits per quantizable weight."
    )
    predicted_ratio: float | None = Field(
        default=None, description="What the sensitivities predicted for a mixed-precision round."
    )


class TargetSearch(BaseModel):
    """What compressing to a target tried, and what it chose: the manifest's `target`."""

    max_perplexity_ratio: float
    max_rounds: int
    base_perplexity: float = Field(description="The base model's held-out perplexity.")
    held_out_source: str
    held_out_samples: int
    excluded_calibration_samples: int = Field(
        default=0, description="Held-out rows left out because calibration used them."
    )
    ranked_modules: int = Field(
        description="Modules with a round-1 GPTQ error, the candidates to leave unquantized."
    )
    rounds: list[TargetRound]
    chosen_round: int | None = Field(
        default=None, description="The round published; None when no round met the target."
    )
    avg_bits: float = Field(default=0, description="The bits-per-weight budget (0: none).")
    mix: MixedPrecision | None = Field(
        default=None,
        description="Mixed precision: what was chosen per module, and the trade-off; None: the "
        "search left modules unquantized.",
    )

    def chosen(self) -> TargetRound | None:
        return next((r for r in self.rounds if r.round == self.chosen_round), None)

    def best(self) -> TargetRound:
        """The lowest ratio reached (fewest modules unquantized among equals)."""
        return min(self.rounds, key=lambda r: (r.ratio, len(r.unquantized)))

    def size_cost_bytes(self) -> int:
        """How much larger the chosen output is than the recipe as asked (round 1)."""
        chosen = self.chosen()
        return chosen.size_bytes - self.rounds[0].size_bytes if chosen else 0

    def log_to(self, tracker) -> None:
        for r in self.rounds:
            tracker.scalar("target perplexity ratio", "round", r.ratio, r.round)
            tracker.scalar("target modules unquantized", "round", len(r.unquantized), r.round)
        tracker.table(
            "compress to target",
            [
                {
                    "round": r.round,
                    "unquantized": len(r.unquantized),
                    "avg_bits": r.avg_bits,
                    "ratio": round(r.ratio, 5),
                    "target": self.max_perplexity_ratio,
                    "met": r.met,
                    "size_bytes": r.size_bytes,
                    "chosen": r.round == self.chosen_round,
                }
                for r in self.rounds
            ],
        )
        if self.mix is not None:
            for measured, series in ((False, "predicted"), (True, "measured")):
                tracker.scatter(
                    "size vs held-out perplexity",
                    series,
                    [[p.avg_bits, p.perplexity] for p in self.mix.points if p.measured == measured],
                    ("bits per weight", "held-out perplexity"),
                )
            tracker.table(
                "precision per module",
                [{"module": name, "precision": p} for name, p in self.mix.precisions.items()],
            )
        chosen = self.chosen()
        if chosen is not None:
            tracker.params(
                "target",
                {
                    "max_perplexity_ratio": self.max_perplexity_ratio,
                    "chosen_round": chosen.round,
                    "ratio": chosen.ratio,
                    "size_cost_bytes": self.size_cost_bytes(),
                    "unquantized": ", ".join(chosen.unquantized) or "none",
                },
            )


# verify


class QualityMetrics(BaseModel):
    samples: int
    tokens: int = Field(description="Next-token positions scored.")
    base_perplexity: float
    compressed_perplexity: float
    perplexity_increase_pct: float = Field(description="100 * (compressed / base - 1).")
    kl_divergence: float | None = Field(
        description="Mean KL(base || compressed) per position, in nats; None when the engine "
        "returns top tokens only (vLLM)."
    )
    top1_agreement: float = Field(description="Share of positions where both pick the same token.")


class VerificationCheck(BaseModel):
    name: str
    passed: bool
    detail: str
    checked: bool = Field(
        default=True,
        description="False: this host could not run the check (e.g. no vLLM kernel for the "
        "scheme); `passed` is then False too, and the check does not fail the run.",
    )

    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL" if self.checked else "not checked here"


class ServingCheck(BaseModel):
    """What vLLM did with a checkpoint (compressflow/model/serving.py)."""

    outcome: Literal["served", "not checked", "refused"]
    reason: str = Field(default="", description="Why not served: vLLM's own root-cause line.")
    metrics: QualityMetrics | None = Field(
        default=None, description="Both models scored by vLLM on the held-out tokens."
    )
    vllm_version: str | None = None
    kv_cache_dtype: str | None = Field(
        default=None,
        description="The kv_cache_dtype vLLM was given for the output: fp8 when its config.json "
        "declares a kv_cache_scheme, auto (the model's dtype) otherwise.",
    )
    seconds: float = Field(default=0.0, description="Start, load and score both models.")
    load_seconds: float = Field(default=0.0, description="Of which building both engines.")


class Verification(BaseModel):
    """What the verify stage proved about a staged checkpoint."""

    passed: bool
    checks: list[VerificationCheck]
    cosine: float | None = Field(default=None, description="Mean cosine of logits per position.")
    kl_divergence: float | None = Field(default=None, description="Mean KL(base || compressed).")
    top1_agreement: float | None = Field(default=None, description="Share of same top-1 tokens.")
    logit_limits: dict[str, float] | None = Field(
        default=None,
        description="The limits the three figures above were held to: min_cosine, max_kl, "
        "min_top1 (the scheme family's defaults, or verify's).",
    )
    base_perplexity: float | None = Field(
        default=None,
        description="The base model's perplexity on the verification texts (held out from "
        "calibration), from the same logits: every card's recovery figure, served or not.",
    )
    compressed_perplexity: float | None = Field(
        default=None, description="The compressed model's, on the same texts and logits."
    )
    seconds: float = 0.0
    peak_rss_mb: float | None = Field(
        default=None, description="Process peak resident memory once verified (ru_maxrss)."
    )
    vllm: ServingCheck | None = Field(default=None, description="Served and scored in vLLM.")

    def failed(self) -> list[VerificationCheck]:
        return [check for check in self.checks if check.checked and not check.passed]

    def log_to(self, tracker) -> None:
        tracker.params(
            "verification",
            {
                "passed": self.passed,
                **{check.name: check.detail for check in self.checks},
            },
        )
        for name in ("cosine", "kl_divergence", "top1_agreement"):
            if getattr(self, name) is not None:
                tracker.single(f"verification {name}", getattr(self, name))


# publish


class StageRecord(BaseModel):
    name: str
    seconds: float
    cached: bool


class PublishedModel(BaseModel):
    """Where the compressed model is and what it is: what downstream flows consume."""

    path: str
    run_key: str
    reused: bool = Field(description="True when an earlier run's output was returned as is.")
    model_identity: str
    scheme: str | None
    size_bytes: int
    original_size_bytes: int
    compression_ratio: float
    stages: list[StageRecord] = Field(
        default_factory=list, description="This run's stages: seconds taken and cache hits."
    )
    tracking: str = Field(default="", description="Where ClearML logged the run, or why it failed.")


# evaluate


class LmEvalScores(BaseModel):
    """One model's lm-eval-harness figures (the run_lm_eval stage)."""

    backend: str = Field(
        description="lm-eval's model backend that ran: 'vllm' or 'hf' (transformers)."
    )
    lm_eval_version: str
    metrics: dict[str, float] = Field(description="{'<task>/<metric>': value}.")
    higher_is_better: dict[str, bool] = Field(description="Per metric: whether higher is better.")
    seconds: float = Field(description="Loading the model and running every task.")


class EvaluationReport(BaseModel):
    """What evaluate-model returns. It lives here, not in the flow module: a worker loads the flow
    file by path (as module `evaluate`), and a result pickled from there would not unpickle
    in the process that reads it (e.g. a sweep)."""

    compressed_path: str
    base_identity: str
    scheme: str | None
    held_out_source: str
    excluded_calibration_samples: int
    metrics: QualityMetrics
    lm_eval: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="{'base' | 'compressed': {'<task>/<metric>': value}}."
    )
    lm_eval_backend: str | None = Field(
        default=None, description="lm-eval's backend that scored both models; None: not run."
    )
    lm_eval_recovery: dict[str, float] = Field(
        default_factory=dict,
        description="{'<task>/<metric>': recovery %}: compressed over base, base over compressed "
        "for metrics better lower (perplexities), so 100 is no loss.",
    )
    breaches: list[str] = Field(description="Thresholds passed; empty when within limits.")
    passed: bool
    tracking: str | None = Field(default=None, description="Where ClearML logged the run.")


# sweep


class Point(BaseModel):
    recipe_args: dict[str, Any]
    text_samples: int

    def label(self) -> str:
        values = {**self.recipe_args, "text_samples": self.text_samples}
        return ", ".join(f"{name}={value}" for name, value in values.items())

    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:10]


class PointResult(BaseModel):
    point: Point
    status: Literal["completed", "failed"]
    metrics: dict[str, float] = Field(default_factory=dict)
    objective: float | None = None
    output_path: str | None = None
    runs: dict[str, str] = Field(default_factory=dict, description="Flow run names by stage.")
    error: str | None = None

    def row(self) -> dict:
        return {
            "point": self.point.label(),
            "status": self.status,
            "objective": self.objective,
            **{name: self.metrics.get(name) for name in METRICS},
            "output": self.output_path,
            "runs": ", ".join(f"{stage}: {name}" for stage, name in self.runs.items()),
            "error": self.error,
        }


class SweepReport(BaseModel):
    results: list[PointResult] = Field(description="Completed points best first, then failures.")
    best: PointResult | None


# validate


class Check(BaseModel):
    name: str
    seconds: float
    detail: str


class ValidationReport(BaseModel):
    checks: list[Check]
    output_path: str
    reuses_output: bool

    def table(self) -> str:
        rows = [f"  {c.name:<14} {c.seconds:6.2f} s  {c.detail}" for c in self.checks]
        return "\n".join(["Parameters are valid:", *rows])
