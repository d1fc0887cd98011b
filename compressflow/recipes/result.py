"""What the recipe slice returns: the rendered recipe, and a target strategy's search
(sensitivity, the mix chosen, the rounds tried)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


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
    (compressflow/evaluation/sensitivity.py)."""

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
