"""Compare models: scores the compressed model against its base on held-out text.

Both models read the same tokenized samples; `compressflow.reporting.quality` says what is measured.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.logs import run_logger
from compressflow.reporting.quality import load_causal_lm, score
from compressflow.results import FetchedModel, HeldOutText, QualityMetrics


@task(name="compare models", cache_policy=NO_CACHE)
def compare_models(
    base: FetchedModel, compressed_path: str, held_out: HeldOutText
) -> QualityMetrics:
    """Load both models (both must fit the visible devices) and score them on `held_out`."""
    base_model = load_causal_lm(base.path, base.model_class, base.trust_remote_code)
    compressed = load_causal_lm(compressed_path, base.model_class, base.trust_remote_code)
    metrics = score(base_model, compressed, held_out.input_ids)
    run_logger(__name__).info(
        "Perplexity %.3f -> %.3f (%+.2f%%), KL %.5f nats/token, top-1 agreement %.1f%% over "
        "%d tokens",
        metrics.base_perplexity,
        metrics.compressed_perplexity,
        metrics.perplexity_increase_pct,
        metrics.kl_divergence,
        100 * metrics.top1_agreement,
        metrics.tokens,
    )
    return metrics
