"""Compare models: scores the compressed model against its base on held-out text.

Both models read the same tokenized samples; `compressflow.evaluation.quality` says what is measured.
The engine is transformers (both models in a child process, compressflow.runtime.isolation) or vLLM, the server users run on GPUs
(`compressflow.model.serving`, in the vLLM environment): vLLM returns top tokens, not whole
distributions, so its report has no KL divergence.
"""

from __future__ import annotations

from typing import Literal

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.errors import EvaluationError
from compressflow.evaluation.quality import score_with_transformers
from compressflow.logs import run_logger
from compressflow.model.serving import serve_and_score
from compressflow.results import FetchedModel, HeldOutText, QualityMetrics
from compressflow.runtime.isolation import in_child


def score_in_vllm(base: FetchedModel, compressed_path: str, held_out: HeldOutText):
    served = serve_and_score(base.path, compressed_path, held_out.input_ids, base.trust_remote_code)
    if served.outcome != "served":
        raise EvaluationError(
            "engine",
            f"vLLM did not score {compressed_path}: {served.outcome}: {served.reason}",
            "evaluate with engine 'transformers' (it runs wherever the models load)",
        )
    return served.metrics


@task(name="compare models", cache_policy=NO_CACHE)
def compare_models(
    base: FetchedModel,
    compressed_path: str,
    held_out: HeldOutText,
    engine: Literal["transformers", "vllm"] = "transformers",
) -> QualityMetrics:
    """Score both models on `held_out` with `engine` (transformers: both must fit the visible
    devices at once; vLLM: one after the other)."""
    if engine == "vllm":
        metrics = score_in_vllm(base, compressed_path, held_out)
    else:  # in a child: torch and both models stay out of the flow's process
        metrics = in_child(score_with_transformers, base, compressed_path, held_out)
    kl = "" if metrics.kl_divergence is None else f", KL {metrics.kl_divergence:.5f} nats/token"
    run_logger(__name__).info(
        "%s: perplexity %.3f -> %.3f (%+.2f%%)%s, top-1 agreement %.1f%% over %d tokens",
        engine,
        metrics.base_perplexity,
        metrics.compressed_perplexity,
        metrics.perplexity_increase_pct,
        kl,
        100 * metrics.top1_agreement,
        metrics.tokens,
    )
    return metrics
