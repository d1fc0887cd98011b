"""Every flow's parameters, grouped like llm-compressor's argument groups.

These models are the Prefect UI form, the validation and the reference docs at once: every field
carries its help text, and names follow the seed system's `LLMCompressorTask` (`model_id`,
`recipe_args`, `dataset_name`, `text_samples`, `max_seq_len`, `tags`, ...) where the meaning is
the same. They hold no secrets: hub tokens and ClearML keys come from blocks or the environment.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from compressflow.errors import InputError, RecipeError
from compressflow.limits import check_data
from compressflow.registries.presets import PRESETS, preset_named
from compressflow.registries.thresholds import DEFAULTS, LogitFigures, describe, scheme_family

# `module:function`, never serialized source: loaders are imported, not executed from text.
DEFAULT_MODEL_CLASS = "AutoModelForCausalLM"
IMPORT_PATH_OR_EMPTY = r"^([A-Za-z_][\w.]*:[A-Za-z_]\w*)?$"
# Prefect's rule for block document names (prefect.types.names.BlockDocumentName). A token pasted
# into a `*_block` field (hf_..., a ClearML key) breaks it: refused here and by the deployment's
# schema, it never reaches a run's parameters, the manifest or ClearML.
BLOCK_NAME_OR_EMPTY = r"^[a-z0-9-]*$"
TAG = r"^[^\x00-\x1f\x7f]+$"  # no newline or other control character
_LIMITS = describe()


def _block_name(value: Any, field: str) -> Any:
    """`value` when it can name a block. Refused without repeating it: it may be the secret."""
    if isinstance(value, str) and not re.fullmatch(BLOCK_NAME_OR_EMPTY, value):
        raise InputError(
            field,
            "the value (not shown) looks like a secret value, not a block name: block names are "
            "lowercase letters, digits and dashes",
            "give the name of the block that holds the secret, never the secret itself (and "
            "revoke a token that was pasted here)",
        )
    return value


def _plain_path(group: str):
    """A validator refusing a path or id field that holds a NUL byte (every file-system call on
    it raised a bare "ValueError: embedded null byte" from deep inside a check) or spaces at
    either end (a pasted path: "   " made a folder of spaces in the worker's directory)."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and "\x00" in value:
            raise InputError(
                f"{group}.{info.field_name}",
                f"{value[:60]!r} holds a NUL byte (\\x00), which no file or folder name can hold",
                "remove it (copying from a binary file or a C string brings one in)",
            )
        if isinstance(value, str) and value != value.strip():
            raise InputError(
                f"{group}.{info.field_name}",
                f"{value[:60]!r} has spaces at its start or end, which a pasted path brings in",
                f"give it as {value.strip()[:60]!r}"
                if value.strip()
                else "give a path, or leave it empty for the default",
            )
        return value

    return check


class _Args(BaseModel):
    # Unknown keys are typos in a deployment's parameters: refuse them instead of ignoring them.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _none_means_default(cls, data: Any) -> Any:
        """No field takes None: unset text, lists and limits are "", [] or 0, because the Prefect
        UI shows a `str | None` type toggle for None-able fields. Callers that still pass None get
        the default (an unknown key stays, to be refused as one)."""
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in cls.model_fields
        }


class ModelArgs(_Args):
    # A token pasted into hub_token_block stays out of a refusal's text (errors() keeps it).
    model_config = ConfigDict(hide_input_in_errors=True)
    _paths = field_validator("model_id", mode="before")(_plain_path("model"))

    model_id: str = Field(
        min_length=1,
        description="Hugging Face model id (e.g. meta-llama/Llama-3.2-1B-Instruct), a local "
        "folder, or a ClearML model id when clearml_model is true.",
    )
    clearml_model: bool = Field(
        default=False, description="model_id is a ClearML model id, fetched with the ClearML SDK."
    )
    revision: str = Field(
        default="",
        description="Hub branch, tag or commit to fetch (empty: main). The resolved commit sha is "
        "recorded either way; pin a sha for reproducible runs.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Run the model repository's own Python code. Off unless you trust the repo.",
    )
    model_class: str = Field(
        default=DEFAULT_MODEL_CLASS,
        pattern=r"^[A-Za-z_]\w*$",
        description="transformers class used to load the model; with the default, a model "
        "AutoModelForCausalLM cannot load (e.g. vision-language) uses the class its config names.",
    )
    hub_token_block: str = Field(
        default="",
        pattern=BLOCK_NAME_OR_EMPTY,
        description="Name of a Prefect Secret block holding a Hugging Face token (the name, never "
        "the token). Empty: HF_TOKEN from the worker's environment, if set.",
    )

    @field_validator("hub_token_block", mode="before")
    @classmethod
    def _a_name_not_a_token(cls, value: Any) -> Any:
        return _block_name(value, "model.hub_token_block")  # before the pattern, which echoes


class TextSourceArgs(_Args):
    """Where text comes from: shared by calibration data and held-out evaluation text."""

    _paths = field_validator("dataset_name", mode="before")(_plain_path("dataset"))

    dataset_name: str = Field(
        default="python_docs",
        min_length=1,
        description="A registered shortcut (see compressflow.registries.datasets), a hub dataset "
        "id, or a local .txt/.jsonl/.json/.parquet/.csv/.arrow file or a folder of them (up to "
        "COMPRESSFLOW_MAX_DATA_MB, 1 GiB by default).",
    )
    dataset_config_name: str = Field(
        default="", description="Hub dataset configuration (subset) name; empty: the default one."
    )
    split: str = Field(
        default="", description="Split to sample from; empty: a shortcut's default, else train."
    )
    text_column: str = Field(
        default="",
        description="Column holding the text or the chat messages; a shortcut's default, else "
        "'text' or 'messages' when present.",
    )
    dataset_loader: str = Field(
        default="",
        pattern=IMPORT_PATH_OR_EMPTY,
        description="`module:function` returning a datasets.Dataset, called with the DatasetArgs; "
        "replaces the built-in loading. Empty: the built-in loading.",
    )


class DatasetArgs(TextSourceArgs):
    text_samples: int = Field(
        default=256, ge=0, description="Number of calibration samples (0 for data-free recipes)."
    )
    vision_samples: int = Field(
        default=0, ge=0, description="Number of image samples; needs a model with a processor."
    )
    max_seq_len: int = Field(default=2048, gt=0, description="Maximum tokens per sample.")
    seed: int = Field(default=42, description="Seed for sampling rows: same seed, same samples.")
    data_collator: str = Field(
        default="",
        pattern=IMPORT_PATH_OR_EMPTY,
        description="`module:function` used as oneshot's data_collator; empty: the default.",
    )


PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


def _preset_help() -> str:
    lines = ["A named recipe (below); `recipe_args` override its placeholders' defaults."]
    for name, preset in PRESETS.items():
        defaults = ", ".join(f"`{key}`={value!r}" for key, value in preset.defaults().items())
        lines.append(f"- **{name}**: {preset.description} Placeholders: {defaults or 'none'}.")
    return "\n\n".join(lines)  # paragraphs: the UI joins single-newline list items into one


class RecipeArgs(_Args):
    preset: PresetName = Field(default="W4A16", description=_preset_help())
    recipe: str = Field(
        default="",
        description="Your own recipe instead of the preset: YAML text or the path of a .yaml "
        "file (from Python also a dict, or a list of modifier dicts). Empty: the preset is used.",
    )
    recipe_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Values for the recipe's `$name` placeholders; each is inserted as a YAML "
        "value (numbers stay numbers, lists stay lists).",
    )
    kv_cache: Literal["off", "fp8"] = Field(
        default="off",
        description="fp8: store the KV cache in FP8, with one static scale per tensor for keys "
        "and one for values, calibrated on the calibration samples (so a data-free preset such "
        "as FP8_DYNAMIC then needs samples); about twice the context in the same memory. Sets "
        "the preset's kv_cache_scheme, or adds kv_cache_scheme to your own recipe's quantizing "
        "modifiers. vLLM serves it with --kv-cache-dtype fp8 (its CPU build on x86 CPUs with "
        "AVX-512 or AMX only). off: the KV cache stays in the model's dtype, unless the recipe "
        "says otherwise.",
    )
    pipeline: Literal["auto", "independent", "sequential", "basic", "datafree"] = Field(
        default="auto",
        description="Calibration pipeline; auto: llm-compressor picks one from the recipe.",
    )
    sequential_targets: list[str] = Field(
        default_factory=list,
        description="Module class names calibrated one at a time by the sequential pipeline "
        "(empty: the model's decoder layer).",
    )
    tracing_ignore: list[str] = Field(
        default_factory=list,
        description="Function or module names the tracer skips (empty: llm-compressor's "
        "defaults); add the one a trace error names.",
    )

    @model_validator(mode="before")
    @classmethod
    def _older_forms(cls, data: Any) -> Any:
        """`recipe: W4A16` (the seed's form: a preset name in `recipe`) selects the preset, and a
        preset name in any case is accepted."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("recipe"), str) and (name := preset_named(data["recipe"])):
            data["preset"], data["recipe"] = name, ""
        if isinstance(data.get("preset"), str):
            data["preset"] = preset_named(data["preset"]) or data["preset"]
        return data

    @field_validator("recipe", mode="before")
    @classmethod
    def _structured_recipe_as_yaml(cls, value: Any) -> Any:
        # One stored form: the UI edits text, and a deployment's schema then checks a string.
        if isinstance(value, (dict, list)):
            return yaml.safe_dump(value, sort_keys=False)
        return value

    @field_validator("recipe_args", mode="before")
    @classmethod
    def _bounded_args(cls, value: Any) -> Any:
        # Before anything walks them: shared lists from Python or a YAML file expand when dumped.
        check_data(value, "recipe.recipe_args", RecipeError)
        return value

    def source(self) -> str:
        """What renders: the user's own recipe when given, else the preset's name."""
        return self.recipe or self.preset

    def label(self) -> str:
        """The preset's name, or "custom": names runs, artifacts and ClearML tasks."""
        return "custom" if self.recipe else self.preset


# The share of a GPU's free memory the memory plan fills when no cap is set. Its terms leave out
# what also lands on the device: the caching allocator's rounding and fragmentation, and the CUDA
# contexts of the run's other children (on an H100, a run planned at 2.1 GiB peaked at 3186 MB in
# use device-wide, benchmarks/README.md), and free memory read at planning time can shrink before
# calibration starts. A tenth (7.9 GiB of an H100's 78.7 GiB free) holds that, and the last tenth
# is never worth an out-of-memory error hours into a run.
GPU_SHARE = 0.9


class CalibrationArgs(_Args):
    """How calibration runs: the path, where the weights live, and llm-compressor's speed knobs.

    The defaults need no tuning: a memory plan made from the model's config before any weights
    load picks where the weights live and the batch size, and refuses what cannot fit.
    """

    _paths = field_validator("offload_folder", mode="before")(_plain_path("calibration"))

    path: Literal["auto", "classic", "model_free"] = Field(
        default="auto",
        description="auto: a data-free scheme (e.g. FP8_DYNAMIC) whose weights can be quantized "
        "without building the model goes through llm-compressor's model_free_ptq, one shard at a "
        "time; everything else loads the model and runs oneshot (classic). classic forces "
        "oneshot; model_free refuses a recipe that path cannot run.",
    )
    batch_size: int = Field(
        default=0,
        ge=0,
        le=512,
        description="Calibration samples per forward pass; 0 picks the largest of 16, 8, 4, 2 "
        "that fits in memory and cuts at most 2% of the tokens (each batch is cut to its "
        "shortest sample); 1, the only size they take, for AutoRound and image+text data.",
    )
    sequential_prefetch: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Load the next batch onto the GPU while the current one runs (auto: on when "
        "calibrating on a GPU with room for two batches).",
    )
    sequential_offload_device: Literal["cpu", "cuda"] = Field(
        default="cpu",
        description="Where activations between layers wait (cpu: the most room; cuda: faster "
        "when the GPU holds them).",
    )
    moe_calibrate_all_experts: bool = Field(
        default=True,
        description="Send every token through every expert of an MoE layer while calibrating, so "
        "no expert is quantized from too few tokens.",
    )
    max_cpu_memory_gb: float = Field(
        default=0,
        ge=0,
        description="Cap on the CPU memory the run plans to use, in GiB; 0 means what the worker "
        "has available. Weights that do not fit under it are read from disk layer by layer.",
    )
    max_gpu_memory_gb: float = Field(
        default=0,
        ge=0,
        allow_inf_nan=False,
        description="Cap on the peak GPU memory calibration plans for, in GiB, for a GPU shared "
        f"with other work; 0: {GPU_SHARE:.0%} of the GPU's free memory. The automatic batch "
        "shrinks to fit under it; a run that cannot fit even at batch 1 is refused before weights "
        "load. A worker without a GPU ignores it (the plan's notes say so).",
    )
    timeout_minutes: float = Field(
        default=0,
        ge=0,
        description="Stop calibration after this many minutes (0: no limit). It runs in a "
        "process of its own, so stopping it ends it and returns its memory.",
    )
    offload_folder: str = Field(
        default="",
        description="Local folder for weights offloaded to disk; empty: a temporary folder beside "
        "the output, removed after the run.",
    )
    gpus: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs one calibration uses. 1: one process on one free GPU of the host. "
        "More: llm-compressor's distributed oneshot, one process per GPU under torchrun; a host "
        "with fewer GPUs refuses the run before any weights load.",
    )
    checkpoint_interval_s: float = Field(
        default=600,
        allow_inf_nan=False,
        description="Save calibration's progress (finished layers and the activations feeding "
        "the next) at most this often, in seconds, under the cache folder, so a rerun after a "
        "crash resumes from the last finished layer; 0: after every layer; negative: never. "
        "Deleted once the model is published.",
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="CPU threads calibration runs (torch, OpenMP, tokenizers). 0: the CPUs this "
        "worker may use (its affinity mask and cgroup CPU quota, not the host's core count), "
        "shared with the other compressflow processes computing on this host.",
    )


class OutputArgs(_Args):
    _paths = field_validator("save_directory", mode="before")(_plain_path("output"))

    save_directory: str = Field(
        default="",
        description="Where the compressed model is published. Empty: a folder named "
        "MODEL-SCHEME under $COMPRESSFLOW_OUTPUT_DIR (or ./outputs).",
    )
    # Tags go to the Prefect server, ClearML and the manifest of every run: bounded, one line each.
    tags: list[Annotated[str, Field(min_length=1, max_length=100, pattern=TAG)]] = Field(
        default_factory=list,
        max_length=50,
        description="Tags for the Prefect run, ClearML and the manifest (the scheme is added): "
        "at most 50, each one line of at most 100 characters.",
    )
    save_compressed: bool = Field(
        default=True, description="Save in compressed-tensors format (what vLLM serves)."
    )
    overwrite: bool = Field(
        default=False,
        description="Replace an earlier compressflow output at save_directory: only the files its "
        "manifest lists are deleted, and a folder holding anything else is refused.",
    )
    auto_evaluate: bool = Field(
        default=True,
        description="Let the evaluate-model deployment's trigger evaluate this output (its "
        "published event says so); sweeps turn it off and evaluate their points themselves.",
    )

    @field_validator("tags", mode="before")
    @classmethod
    def _one_line_each(cls, tags: Any) -> Any:
        # Before the pattern, whose own message shows a regex instead of the problem.
        for number, tag in enumerate(tags if isinstance(tags, list) else []):
            if isinstance(tag, str) and re.search(r"[\x00-\x1f\x7f]", tag):
                raise InputError(
                    "output.tags",
                    f"tag {number + 1}, {tag[:40]!r}, holds a newline or another control character",
                    "write each tag as one line of plain text",
                )
        return tags


class TrackingArgs(_Args):
    model_config = ConfigDict(hide_input_in_errors=True)  # as ModelArgs: clearml_block

    enabled: bool = Field(default=True, description="Log the run to ClearML.")
    clearml_block: str = Field(
        default="",
        pattern=BLOCK_NAME_OR_EMPTY,
        description="Name of a ClearMLSettings block. Empty (and without CLEARML_* environment "
        "variables): ClearML runs in offline mode.",
    )
    project_name: str = Field(
        default="", description="ClearML project; empty: the block's default project."
    )
    task_name: str = Field(
        default="", description="ClearML task name; empty: the model's name and the scheme."
    )

    @field_validator("clearml_block", mode="before")
    @classmethod
    def _a_name_not_a_key(cls, value: Any) -> Any:
        return _block_name(value, "tracking.clearml_block")  # as ModelArgs.hub_token_block


class VerifyArgs(_Args):
    """The checks a compressed checkpoint must pass before it is published.

    The logits limits default to the scheme family's (compressflow/registries/thresholds.py),
    measured on a model with learned weights: 8-bit schemes must stay much closer to the base
    than 4-bit ones. A limit set here wins for every scheme.
    """

    samples: int = Field(
        default=4,
        ge=1,
        le=16,
        description="Held-out texts (Python builtins' docstrings, never calibration data) the "
        "base and the compressed model both read; their next-token logits are compared.",
    )
    max_seq_len: int = Field(default=64, ge=2, le=2048, description="Tokens per held-out text.")
    min_cosine: float = Field(
        default=0,
        ge=0,
        le=1,
        description="Smallest allowed mean cosine similarity between the base's and the compressed "
        "model's logits per position. 0: the scheme family's default (" + _LIMITS + ").",
    )
    max_kl: float = Field(
        default=0,
        ge=0,
        description="Largest allowed mean KL(base || compressed) per position, in nats. 0: the "
        "scheme family's default.",
    )
    min_top1: float = Field(
        default=0,
        ge=0,
        le=1,
        description="Smallest allowed share of positions where both models pick the same token. "
        "0: the scheme family's default.",
    )
    vllm: Literal["auto", "required", "off"] = Field(
        default="auto",
        description="Serve the output in vLLM before publishing, and score it against the base "
        "model served the same way. auto: when the worker has a vLLM environment "
        "(COMPRESSFLOW_VLLM_PYTHON, or the project's .venv-vllm); required: refuse to run "
        "without one, and to publish a model it could not check; off: never.",
    )
    vllm_max_perplexity_increase_pct: float = Field(
        default=10.0,
        ge=0,
        description="Largest allowed perplexity increase in vLLM over the base model in vLLM, "
        "in percent, on the held-out texts.",
    )
    vllm_min_top1: float = Field(
        default=0.4,
        ge=0,
        le=1,
        description="Smallest allowed share of positions where vLLM picks the same token for "
        "both models.",
    )

    def logit_limits(self, scheme: str | None) -> LogitFigures:
        """The limits the logits check applies to an output of `scheme`: the family's defaults,
        with any limit set here in their place."""
        family = DEFAULTS[scheme_family(scheme)]
        return LogitFigures(
            cosine=self.min_cosine or family.cosine,
            kl=self.max_kl or family.kl,
            top1=self.min_top1 or family.top1,
        )


# evaluate-model


class HeldOutArgs(TextSourceArgs):
    """Evaluation text. When it is the calibration dataset, the calibration samples are left out."""

    samples: int = Field(default=32, gt=0, description="Number of held-out texts scored.")
    max_seq_len: int = Field(default=512, gt=1, description="Maximum tokens per text.")
    seed: int = Field(
        default=1234, description="Seed for sampling held-out rows (calibration's default is 42)."
    )

    def dataset_args(self) -> DatasetArgs:
        fields = self.model_dump(exclude={"samples"})
        return DatasetArgs(**fields, text_samples=self.samples)


# compress-model's target: measured on held-out text, as evaluate-model measures

MAX_TARGET_ROUNDS = 12  # each round is a full calibration


class TargetArgs(_Args):
    """Compress to a target: the smallest configuration whose held-out perplexity stays within
    `max_perplexity_ratio` of the base model's.

    Round 1 calibrates the recipe as asked. When it misses, later rounds leave the modules GPTQ
    measured the largest error on unquantized (1, 2, 4, ... of them, then bisecting between the
    last miss and the first hit), each a full calibration; the smallest set that meets the target
    is published, and a search that ends without one publishes nothing.
    """

    max_perplexity_ratio: float = Field(
        default=0,
        ge=0,
        le=10,
        description="Largest allowed held-out perplexity of the compressed model over the base "
        "model's, e.g. 1.02 for at most 2% worse (0: no target; the recipe runs as asked). Needs "
        "a recipe with a GPTQModifier (W4A16, W8A8, ...), whose per-module error ranks the layers.",
    )
    held_out: HeldOutArgs = Field(
        default_factory=HeldOutArgs,
        description="Text the perplexities are measured on; when it is the calibration dataset, "
        "the calibration samples are left out.",
    )
    max_rounds: int = Field(
        default=6,
        ge=1,
        le=MAX_TARGET_ROUNDS,
        description="Most calibrations the search may run, the recipe as asked included; each "
        "round costs one full calibration.",
    )
    avg_bits: float = Field(
        default=0,
        ge=0,
        le=16,
        description="A size budget instead of (or with) a ratio: at most this many bits per "
        "quantizable weight, scales included, with the lowest held-out perplexity the "
        "sensitivities predict (e.g. 4.5 with W4A16: most modules int4, the most sensitive int8 "
        "or 16-bit). Needs the preset W4A16 (int4/int8/16) or NVFP4A16 (fp4/fp8/16). 0: none.",
    )
    method: Literal["auto", "mixed_precision", "leave_unquantized"] = Field(
        default="auto",
        description="How a ratio target is met. mixed_precision: each module's sensitivity is "
        "measured once on the held-out text and a precision is chosen per module, then "
        "calibrated once (twice when the estimate misses). leave_unquantized: the modules with "
        "the largest GPTQ error stay in 16 bits, a full calibration per round. auto: "
        "mixed_precision for the presets it knows (W4A16, NVFP4A16), else leave_unquantized.",
    )

    def wanted(self) -> bool:
        """Whether the run has a target: a ratio, a bits-per-weight budget, or both."""
        return bool(self.max_perplexity_ratio or self.avg_bits)

    @field_validator("max_perplexity_ratio")
    @classmethod
    def _ratio_is_a_loss(cls, value: float) -> float:
        if 0 < value < 1:
            raise InputError(
                "target.max_perplexity_ratio",
                f"{value} asks the compressed model to score a lower perplexity than the base "
                "model, which no compression is expected to do",
                "give a ratio of 1.0 or more (1.02: at most 2% worse than the base), or 0 for "
                "no target",
            )
        return value


class QualityGate(_Args):
    max_perplexity_increase_pct: float = Field(
        default=10.0,
        ge=0,
        description="Largest allowed perplexity increase over the base model, in percent "
        "(0: no limit).",
    )
    max_kl: float = Field(
        default=0.1,
        ge=0,
        description="Largest allowed mean KL(base || compressed) per token, in nats (0: no limit).",
    )
    min_lm_eval_recovery_pct: float = Field(
        default=0,
        ge=0,
        description="Smallest allowed recovery of each lm-eval metric, in percent of the base "
        "model's score (inverted for perplexities; 100: no loss), e.g. 95 (0: no limit).",
    )
    on_threshold: Literal["fail", "flag"] = Field(
        default="fail",
        description="fail: the run fails when a limit is passed. flag: it completes, with "
        "passed=false in its result, a warning and the artifact marking the breach.",
    )


class LmEvalArgs(_Args):
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-eval-harness tasks run on both models: lm-eval's own names (e.g. "
        "hellaswag; their datasets come from the hub, so an offline worker refuses them), or "
        "ours, which run offline on held-out text: compressflow_code_perplexity (word "
        "perplexity) and compressflow_next_line (which of four lines comes next).",
    )
    limit: int = Field(default=0, ge=0, description="Examples per lm-eval task (0: all of them).")
    held_out_file: str = Field(
        default="",
        description="JSON-lines file of {'text': ...} rows our compressflow_* tasks are built "
        "from (the yardstick's held_out.jsonl is one); empty: the held-out texts this "
        "evaluation scores (held_out).",
    )
    timeout_minutes: float = Field(
        default=60,
        ge=0,
        description="Stop lm-eval on a model after this many minutes (0: no limit). It runs in "
        "a process of its own, so stopping it ends it and returns its memory.",
    )


# sweep-recipe

METRICS = ("perplexity_increase_pct", "kl_divergence", "top1_agreement", "compressed_perplexity")


class SearchSpace(_Args):
    # minItems in the schema: the server refuses an empty list before a run starts.
    recipe_args: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(
        default_factory=dict,
        description="Values to try for each recipe placeholder, e.g. "
        "{dampening_frac: [0.01, 0.1], block_size: [64, 128]}.",
    )
    text_samples: list[int] = Field(
        default_factory=list,
        description="Calibration sample counts to try; empty: dataset.text_samples only.",
    )
    strategy: Literal["grid", "random"] = Field(
        default="grid", description="grid: every combination; random: `budget` of them."
    )
    budget: int = Field(default=0, ge=0, description="Random search: how many points (0: all).")
    seed: int = Field(default=0, description="Random search: which points are drawn.")

    @field_validator("recipe_args", mode="before")
    @classmethod
    def _bounded_args(cls, value: Any) -> Any:
        check_data(value, "space.recipe_args", RecipeError)  # as RecipeArgs.recipe_args
        return value

    @field_validator("recipe_args", mode="before")
    @classmethod
    def _no_empty_values(cls, value: Any) -> Any:
        # An empty list leaves the grid without a single point: refused here, with the fix.
        if isinstance(value, dict):
            empty = [
                name for name, values in value.items() if isinstance(values, list) and not values
            ]
            if empty:
                raise InputError(
                    "space.recipe_args",
                    f"the list of values to try for {', '.join(empty)} is empty, so the search has "
                    "no point to run",
                    f"give {empty[0]} at least one value, or leave it out of the search (the "
                    "recipe's own value is then used)",
                )
        return value


class Objective(_Args):
    metric: Literal[METRICS] = Field(  # type: ignore[valid-type]
        default="kl_divergence", description="An evaluate-model metric to rank points by."
    )
    direction: Literal["minimize", "maximize"] = Field(
        default="minimize", description="Whether the best point has the lowest or highest metric."
    )


class Deployments(_Args):
    compress: str = Field(default="compress-model/compress", description="flow/deployment name.")
    evaluate: str = Field(default="evaluate-model/evaluate", description="flow/deployment name.")
