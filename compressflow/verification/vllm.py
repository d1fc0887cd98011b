"""Check 5, vllm: vLLM, the server the checkpoint is for, loads it and scores the held-out texts
close to the base model served the same way (compressflow/model/serving.py)."""

from __future__ import annotations

from pathlib import Path

from compressflow.model.serving import serve_and_score, vllm_python
from compressflow.params import VerifyArgs
from compressflow.results import FetchedModel, PublishedModel, ServingCheck, VerificationCheck
from compressflow.store.manifest import read_manifest
from compressflow.verification import Check, Verifying


def check_vllm(
    staging: Path, model: FetchedModel, prompts: list[list[int]], args: VerifyArgs
) -> tuple[VerificationCheck, ServingCheck | None]:
    """Serve the output and the base model in vLLM on the held-out tokens, and judge it."""
    name = CHECK.name
    if args.vllm == "off":
        return VerificationCheck(name=name, passed=False, checked=False, detail="off"), None
    served = serve_and_score(model.path, str(staging), prompts, model.trust_remote_code)
    if served.outcome == "refused":
        detail = f"vLLM {served.vllm_version} refused it: {served.reason}"
        return VerificationCheck(name=name, passed=False, detail=detail), served
    if served.outcome == "not checked":
        return VerificationCheck(
            name=name,
            passed=False,
            # required: this host was meant to prove it, and could not
            checked=args.vllm == "required",
            detail=served.reason,  # the verdict says "not checked here"
        ), served
    m = served.metrics
    passed = (
        m.perplexity_increase_pct <= args.vllm_max_perplexity_increase_pct
        and m.top1_agreement >= args.vllm_min_top1
    )
    kv_cache = " with an FP8 KV cache" if served.kv_cache_dtype == "fp8" else ""
    detail = (
        f"served by vLLM {served.vllm_version}{kv_cache}: perplexity "
        f"{m.perplexity_increase_pct:+.2f}% "
        f"(max +{args.vllm_max_perplexity_increase_pct}%), top-1 {m.top1_agreement:.1%} (min "
        f"{args.vllm_min_top1:.0%}), {m.tokens} positions, {served.seconds:.0f} s"
    )
    return VerificationCheck(name=name, passed=passed, detail=detail), served


def vllm_not_run(published: PublishedModel, args: VerifyArgs) -> bool:
    """Whether a reused output was published without vLLM's check (no vLLM environment then)
    and this worker can run it now: then a reuse checks it rather than report a stale "not
    checked". An output vLLM ran on and could not serve on that host is not checked again."""
    if args.vllm == "off" or vllm_python() is None:
        return False
    manifest = read_manifest(Path(published.path))
    served = manifest.verification.vllm if manifest and manifest.verification else None
    return served is None or served.vllm_version is None


def vllm_check(state: Verifying) -> VerificationCheck | None:
    """vLLM's check, last and only when every other check passed: it is the slowest."""
    if not state.reference or not all(check.passed for check in state.checks):
        return None
    check, state.served = check_vllm(
        state.staging, state.model, state.reference["input_ids"], state.args
    )
    return check


CHECK = Check(
    name="vllm",
    field="verify",
    fix="vLLM refused the output or scored it too far from the base model: a refusal names "
    "vLLM's reason (report the architecture and scheme; meanwhile try another scheme); for "
    "scores, use a gentler recipe or relax verify.vllm_max_perplexity_increase_pct / "
    "verify.vllm_min_top1; verify.vllm off publishes without serving it",
    function=vllm_check,
)
