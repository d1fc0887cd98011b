"""Verify: proves a staged checkpoint is what a server will load, and still the base model.

The Prefect face of the stage: it runs the checks in a child process, logs each verdict, records
the result (ClearML, a Prefect artifact) and raises VerificationError, with the field and fix the
failed check's registry entry names, when one fails. The checks, their order and what each
proves live in compressflow/verification/ (`registry.CHECKS`, `run.run_checks`).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from compressflow.errors import VerificationError
from compressflow.logs import run_logger
from compressflow.model.offload import stage_offload_folder
from compressflow.params import VerifyArgs
from compressflow.reporting import tracking
from compressflow.reporting.artifacts import artifact_key, display_name, logit_figures
from compressflow.reporting.model_card import edit_card, verification_list, with_verification
from compressflow.results import (
    Calibration,
    FetchedModel,
    MemoryPlan,
    PublishedModel,
    RenderedRecipe,
    Verification,
)
from compressflow.runtime.isolation import in_child
from compressflow.store.manifest import read_manifest, replace_manifest
from compressflow.verification.registry import CHECKS
from compressflow.verification.run import run_checks, serve_published


def verification_markdown(result: Verification, target: str, name: str) -> str:
    verdict = "passed" if result.passed else "FAILED: not published"
    figures = logit_figures(result)
    return (
        f"# Verification of {name}: {verdict}\n\n`{target}`\n\n"
        + (f"Against the base model: {figures}.\n\n" if figures else "")
        + verification_list(result)
    )


@task(name="verify", cache_policy=NO_CACHE)
def verify(
    calibration: Calibration,
    model: FetchedModel,
    recipe: RenderedRecipe,
    plan: MemoryPlan,
    args: VerifyArgs,
    target: str,
) -> Verification:
    """Reload the staged checkpoint and prove it; raise VerificationError when it fails."""
    with stage_offload_folder(plan, "verify") as own:
        result = in_child(run_checks, calibration, model, recipe, own, args)
    log = run_logger(__name__)
    for check in result.checks:
        (log.info if check.passed else log.error if check.checked else log.warning)(
            "verify %s: %s: %s", check.name, check.verdict(), check.detail
        )
    tracking.log_result(result)
    create_markdown_artifact(
        verification_markdown(result, target, display_name(model.model_id, recipe.source)),
        key=artifact_key(model.model_id, recipe.source, "verification"),
    )
    if not result.passed:
        first = CHECKS[result.failed()[0].name]
        raise VerificationError(
            recipe.given_in() if first.field == "recipe" else first.field,
            "the compressed model failed verification and was not published: "
            + "; ".join(f"{check.name}: {check.detail}" for check in result.failed()),
            first.fix,
        )
    return result


@task(name="verify", cache_policy=NO_CACHE)
def verify_reused(published: PublishedModel, model: FetchedModel, args: VerifyArgs) -> None:
    """Serve a reused output in vLLM (`vllm_not_run`) and record the verdict in its manifest and
    model card; VerificationError when vLLM refuses it or it misses vLLM's limits."""
    folder = Path(published.path)
    check, served = in_child(serve_published, published, model, args)
    manifest = read_manifest(folder)
    checks = [c for c in manifest.verification.checks if c.name != check.name] + [check]
    manifest.verification = manifest.verification.model_copy(
        update={
            "checks": checks,
            "vllm": served,
            "passed": all(c.passed or not c.checked for c in checks),
        }
    )
    replace_manifest(folder, manifest)
    edit_card(folder, lambda card: with_verification(card, manifest))
    log = run_logger(__name__)
    (log.info if check.passed else log.error if check.checked else log.warning)(
        "verify %s (reused output, published %s): %s: %s",
        check.name,
        manifest.created_at,
        check.verdict(),
        check.detail,
    )
    tracking.log_result(manifest.verification)
    if not manifest.verification.passed:
        raise VerificationError(
            CHECKS[check.name].field,
            f"{folder} was published without vLLM's check (none was available then), and vLLM "
            f"fails it now: {check.detail}; its manifest and card say so",
            CHECKS[check.name].fix + "; rerun with output.overwrite: true to compress it again",
        )
