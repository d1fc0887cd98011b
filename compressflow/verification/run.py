"""What the verify stage's children run: every check in sequence (`run_checks`), cheapest first,
the model-free one pass, reload, logits, vLLM last; and vLLM's check of a reused output
(`serve_published`). The checks' order and what they record: `registry.CHECKS`."""

from __future__ import annotations

import resource
import time
from pathlib import Path

from compressflow.data.text_sources import load_processor
from compressflow.params import VerifyArgs
from compressflow.reporting.quality import logits_of
from compressflow.reporting.reference import reference_samples, refuse_non_finite
from compressflow.results import (
    Calibration,
    FetchedModel,
    MemoryPlan,
    PublishedModel,
    RenderedRecipe,
    ServingCheck,
    Verification,
    VerificationCheck,
)
from compressflow.verification.config import check_quantization_config
from compressflow.verification.logits import (
    check_logits,
    load_reference,
    one_pass_logits,
    source_logits,
)
from compressflow.verification.names import check_names
from compressflow.verification.reload import reload
from compressflow.verification.vllm import check_vllm
from compressflow.verification.weights import check_weights


def run_checks(
    calibration: Calibration,
    model: FetchedModel,
    recipe: RenderedRecipe,
    plan: MemoryPlan,
    args: VerifyArgs,
) -> Verification:
    """Every check, in a process of its own (the reload holds the model)."""
    started = time.perf_counter()
    staging = Path(calibration.staging_path)
    checks = [
        check_quantization_config(staging, recipe),
        check_names(staging, Path(model.path), model.model_class, model.trust_remote_code),
    ]
    reference = load_reference(calibration)
    one_pass = None
    if plan.path == "model_free":  # the source is unchanged: its logits are taken here
        samples = reference_samples(load_processor(model), args)
        one_pass = one_pass_logits(staging, model, plan, samples)
        base = one_pass.base if one_pass else source_logits(model, plan, samples)
        refuse_non_finite(base, model, "while verifying its compressed copy")
        reference = {"input_ids": samples, "logits": base}
        checks.append(check_weights(staging, Path(model.path), one_pass and one_pass.errors))
    # The one pass read the output's weights already: its reload checks the keys, reading none.
    loaded, reload_check = reload(staging, model, plan, weights=one_pass is None)
    checks.append(reload_check)
    logits = one_pass.logits if one_pass else None
    if reference and loaded is not None and logits is None:
        logits = logits_of(loaded, reference["input_ids"])
    del loaded
    figures: dict = {}
    if logits is not None:
        logits_check, figures = check_logits(logits, reference, args, recipe.scheme)
        checks.append(logits_check)
    served = None
    if reference and all(check.passed for check in checks):  # vLLM last: the slowest check
        vllm_check, served = check_vllm(staging, model, reference["input_ids"], args)
        checks.append(vllm_check)
    return Verification(
        passed=all(check.passed or not check.checked for check in checks),
        checks=checks,
        vllm=served,
        seconds=round(time.perf_counter() - started, 3),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **figures,
    )


def serve_published(
    published: PublishedModel, model: FetchedModel, args: VerifyArgs
) -> tuple[VerificationCheck, ServingCheck | None]:
    """vLLM's check of a published folder, on the held-out tokens verify uses."""
    prompts = reference_samples(load_processor(model), args)
    return check_vllm(Path(published.path), model, prompts, args)
