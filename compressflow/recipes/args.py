"""The recipe slice's parameters: the recipe as asked, and a quality or size target for it."""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from compressflow.arguments import Args
from compressflow.data.args import HeldOutArgs
from compressflow.errors import InputError, RecipeError
from compressflow.limits import check_data
from compressflow.registries.presets import PRESETS, preset_named

PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


def _preset_help() -> str:
    lines = ["A named recipe (below); `recipe_args` override its placeholders' defaults."]
    for name, preset in PRESETS.items():
        defaults = ", ".join(f"`{key}`={value!r}" for key, value in preset.defaults().items())
        lines.append(f"- **{name}**: {preset.description} Placeholders: {defaults or 'none'}.")
    return "\n\n".join(lines)  # paragraphs: the UI joins single-newline list items into one


class RecipeArgs(Args):
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
    prune_experts: float = Field(
        default=0,
        ge=0,
        lt=1,
        description="Mixture-of-experts models only: the fraction of experts to drop from every "
        "MoE layer before quantizing (REAP: the experts whose router-weighted output is smallest "
        "on the calibration samples), e.g. 0.25 keeps 6 of 8. The checkpoint is smaller and "
        "vLLM serves it as the same MoE with fewer experts. 0: off. Refused before calibration "
        "for a dense model, and for a fraction that drops no expert or leaves fewer experts than "
        "the router picks per token.",
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


MAX_TARGET_ROUNDS = 12  # each round is a full calibration


class TargetArgs(Args):
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
