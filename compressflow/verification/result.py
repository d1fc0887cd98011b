"""What verify returns: each check's outcome, vLLM's, and the figures behind them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


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
