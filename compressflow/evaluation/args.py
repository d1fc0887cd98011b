"""evaluate-model's and sweep-recipe's parameters: the quality gate, lm-eval tasks, served
performance, a sweep's space and objective, and the deployments a sweep calls."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from compressflow.arguments import Args
from compressflow.errors import InputError, RecipeError
from compressflow.limits import check_data


class QualityGate(Args):
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
    min_speedup: float = Field(
        default=0,
        ge=0,
        description="Smallest allowed served output throughput of the compressed model over the "
        "base's (a ratio, e.g. 1.2) at the highest concurrency measured (0: no limit). "
        "'Not measured here' and 'no measurable difference' flag the run, never fail it.",
    )
    on_threshold: Literal["fail", "flag"] = Field(
        default="fail",
        description="fail: the run fails when a limit is passed. flag: it completes, with "
        "passed=false in its result, a warning and the artifact marking the breach.",
    )


class LmEvalArgs(Args):
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


class ServedArgs(Args):
    """What serving the compressed model buys: both models served by vLLM with the same flags,
    measured by vLLM's own benchmark (`vllm bench serve`) on one fixed, stated workload."""

    measure: bool = Field(
        default=True,
        description="Serve the base and the compressed model in vLLM with identical settings and "
        "measure output throughput, latency (time to first token, inter-token) and weights "
        "memory. Needs the worker's vLLM environment; a scheme its build cannot serve is "
        "reported as not measured here, with vLLM's reason.",
    )
    input_len: int = Field(
        default=128, ge=8, le=32768, description="Prompt length in tokens, cut from held-out texts."
    )
    output_len: int = Field(
        default=64,
        ge=1,
        le=32768,
        description="Tokens generated per request (end of sequence ignored, so each request "
        "generates exactly this many).",
    )
    concurrency: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: [1, 4],
        min_length=1,
        max_length=8,
        description="Requests in flight at once; each level is measured on both models.",
    )
    prompts: int = Field(
        default=16, ge=1, le=100000, description="Requests per measurement at each level."
    )
    repeats: int = Field(
        default=3,
        ge=1,
        le=20,
        description="Measurements per model and level, interleaved base / compressed. Figures "
        "are medians with their spread; a difference inside the spread is reported as no "
        "measurable difference.",
    )
    seed: int = Field(default=0, description="Which held-out texts become the prompts.")
    timeout_minutes: float = Field(
        default=30,
        ge=0,
        description="Stop measuring after this many minutes and report it as not finished "
        "(0: no limit).",
    )

    @field_validator("concurrency")
    @classmethod
    def _levels_once(cls, value: list[int]) -> list[int]:
        # A level listed twice would be served twice and shown as two rows of one level.
        if twice := sorted({level for level in value if value.count(level) > 1}):
            raise InputError(
                "served.concurrency",
                f"{value} lists the level {twice[0]} more than once",
                f"list each level once, e.g. {sorted(set(value))}",
            )
        return value

    @model_validator(mode="after")
    def _prompts_fill_each_level(self) -> ServedArgs:
        # Fewer requests than a level never put that many in flight: its figures would be a
        # lower level's, labelled as this one.
        if self.prompts < (most := max(self.concurrency)):
            raise InputError(
                "served.prompts",
                f"{self.prompts} requests never put {most} in flight at once, the highest level "
                f"of served.concurrency {self.concurrency}",
                f"served.prompts at least {most} (a few times it holds the level longer), or "
                "lower levels",
            )
        return self


METRICS = ("perplexity_increase_pct", "kl_divergence", "top1_agreement", "compressed_perplexity")


class SearchSpace(Args):
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


class Objective(Args):
    metric: Literal[METRICS] = Field(  # type: ignore[valid-type]
        default="kl_divergence", description="An evaluate-model metric to rank points by."
    )
    direction: Literal["minimize", "maximize"] = Field(
        default="minimize", description="Whether the best point has the lowest or highest metric."
    )


class Deployments(Args):
    compress: str = Field(default="compress-model/compress", description="flow/deployment name.")
    evaluate: str = Field(default="evaluate-model/evaluate", description="flow/deployment name.")
