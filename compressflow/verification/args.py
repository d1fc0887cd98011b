"""The checks a compressed model must pass before it is published, and their limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from compressflow.arguments import Args
from compressflow.registries.thresholds import LogitFigures, default_limits, describe

_LIMITS = describe()


class VerifyArgs(Args):
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

    def logit_limits(self, scheme: str | None, method: str | None = None) -> LogitFigures:
        """The limits the logits check applies to an output of `scheme` made with `method` (the
        recipe's kinds beyond quantization): the method's defaults where measured, else the
        scheme family's, with any limit set here in their place."""
        family, _ = default_limits(scheme, method)
        return LogitFigures(
            cosine=self.min_cosine or family.cosine,
            kl=self.max_kl or family.kl,
            top1=self.min_top1 or family.top1,
        )
