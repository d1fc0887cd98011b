"""What the verify stage's children run: the registry's checks in order (`run_checks`), after the
model-free one pass where the run took that path; and vLLM's check of a reused output
(`serve_published`). The checks' order and what they record: `registry.CHECKS`."""

from __future__ import annotations

import resource
import time
from pathlib import Path

from compressflow.data.tokenizer import load_processor
from compressflow.evaluation.reference import reference_samples, refuse_non_finite
from compressflow.params import VerifyArgs
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
from compressflow.verification import Verifying
from compressflow.verification.logits import load_reference, one_pass_logits, source_logits
from compressflow.verification.registry import CHECKS
from compressflow.verification.vllm import check_vllm


def run_checks(
    calibration: Calibration,
    model: FetchedModel,
    recipe: RenderedRecipe,
    plan: MemoryPlan,
    args: VerifyArgs,
) -> Verification:
    """Every check of the registry, in order, in a process of its own (the reload holds the
    model); each records what it found, or nothing where it does not apply to this run."""
    started = time.perf_counter()
    staging = Path(calibration.staging_path)
    state = Verifying(staging, model, recipe, plan, args, reference=load_reference(calibration))
    if plan.path == "model_free":  # the source is unchanged: its logits are taken here
        samples = reference_samples(load_processor(model), args)
        state.one_pass = one_pass_logits(staging, model, plan, samples)
        base = state.one_pass.base if state.one_pass else source_logits(model, plan, samples)
        refuse_non_finite(base, model, "while verifying its compressed copy")
        state.reference = {"input_ids": samples, "logits": base}
    for check in CHECKS.values():
        if (found := check.function(state)) is not None:
            state.checks.append(found)
    return Verification(
        passed=all(check.passed or not check.checked for check in state.checks),
        checks=state.checks,
        vllm=state.served,
        seconds=round(time.perf_counter() - started, 3),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **state.figures,
    )


def serve_published(
    published: PublishedModel, model: FetchedModel, args: VerifyArgs
) -> tuple[VerificationCheck, ServingCheck | None]:
    """vLLM's check of a published folder, on the held-out tokens verify uses."""
    prompts = reference_samples(load_processor(model), args)
    return check_vllm(Path(published.path), model, prompts, args)
