"""The evaluate-model flow: what a compressed model lost against its base model, and a gate on it.

Given the compressed model (the path, upload URI or ClearML id compress-model published) and its
base model,
it scores both on the same held-out text (perplexity of each, KL divergence of their next-token
distributions, top-1 agreement; see compressflow/evaluation/quality.py), logs them to ClearML and as a Prefect
table artifact, and fails or flags the run when the loss passes the gate's thresholds. lm-eval
tasks (users' own, and the project's offline ones on a held-out file) run on both models as
well when asked for, each metric with its recovery, which the gate can hold to a minimum. What
compression buys is measured beside it (served.measure): both models served by vLLM with the
same flags, their throughput, latency and memory shown in the card's Performance section, a
chart artifact and ClearML; gate.min_speedup holds the throughput ratio to a minimum
(compressflow/evaluation/served_gate.py).

The evaluate-model deployment in prefect.yaml is triggered by `compressflow.model.published`
(compressflow/runtime/events.py), which fills `compressed` and `base` from the event's payload:
`compressed` is the upload URI where the model was uploaded (s3:// or file://), so an evaluation
on another host reads it from the store; only its path otherwise. A model given by URI is
downloaded into the worker's cache (compressflow/store/sources.py) and its results are recorded in
the Prefect artifact and ClearML only: the prefix is not written back.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from prefect import flow

from compressflow.arguments import block_name
from compressflow.errors import (
    EvaluationError,
    InputError,
    PublishError,
    QualityThresholdExceeded,
)
from compressflow.evaluation.harness import backend as lm_eval_backend
from compressflow.evaluation.harness import recovery, recovery_breaches
from compressflow.evaluation.quality import breaches
from compressflow.evaluation.served_gate import SPEED_BREACH, SPEED_FIX, judge_speed
from compressflow.flows.opening import opened
from compressflow.logs import run_logger
from compressflow.model.args import is_store_uri
from compressflow.model.serving import require_vllm
from compressflow.params import (
    HeldOutArgs,
    LmEvalArgs,
    ModelArgs,
    QualityGate,
    ServedArgs,
    TrackingArgs,
)
from compressflow.reporting.artifacts import artifact_key
from compressflow.reporting.evaluation import publish_evaluation
from compressflow.reporting.lineage import (
    checkpoint_asset,
    current_parameters,
    evaluation_asset,
    link_runs,
    materializing,
)
from compressflow.reporting.model_card import CARD, add_evaluation, evaluation_section
from compressflow.results import EvaluationReport, FetchedModel, HeldOutText, LmEvalScores
from compressflow.runtime.stages import Stages
from compressflow.settings import check_settings
from compressflow.store.locks import output_lock
from compressflow.store.manifest import Manifest, changed_files, read_manifest, replace_manifest
from compressflow.store.sources import check_source
from compressflow.tasks.build_held_out import build_held_out
from compressflow.tasks.compare_models import compare_models
from compressflow.tasks.fetch_model import fetch_model, resolve_compressed
from compressflow.tasks.measure_served import measure_served
from compressflow.tasks.run_lm_eval import check_lm_eval, run_lm_eval, write_own_tasks

# How long recording an evaluation waits for its folder's lock: a run reusing the folder holds it
# for seconds; one republishing it, for its whole calibration (the figures are then of the model
# it replaces, and are not recorded).
RECORD_WAIT_SECONDS = 60.0


def lm_eval_scores(
    stages: Stages,
    args: LmEvalArgs,
    base: FetchedModel,
    compressed_path: Path,
    held_out: HeldOutText,
) -> dict[str, LmEvalScores]:
    """lm-eval's tasks on the base model, then on the compressed one, both with one backend:
    vLLM where its environment holds lm-eval and can score the output in time, transformers
    otherwise or where vLLM fails on either; {} when no task was asked for."""
    if not args.tasks:
        return {}
    timed = run_lm_eval.with_options(timeout_seconds=args.timeout_minutes * 60 or None)
    models = (("base", base.path), ("compressed", str(compressed_path)))
    with tempfile.TemporaryDirectory(prefix="compressflow-lm-eval-") as folder:
        include_path = write_own_tasks(args, Path(folder), base, held_out)
        if lm_eval_backend(compressed_path, held_out, args.timeout_minutes) == "vllm":
            try:
                return {
                    which: stages.run(timed, which, path, base, args, include_path, "vllm")
                    for which, path in models
                }
            except EvaluationError as exc:  # a kernel this host lacks: transformers runs it
                run_logger(__name__).warning("%s; lm-eval runs on transformers instead", exc)
        return {
            which: stages.run(timed, which, path, base, args, include_path, "hf")
            for which, path in models
        }


def evaluation_key(base: ModelArgs, manifest: Manifest | None, kind: str = "evaluation") -> str:
    """Named like the compressed model's summary; `custom` when no manifest names the recipe."""
    return artifact_key(base.model_id, manifest.recipe["source"] if manifest else None, kind)


def with_credentials(args: ModelArgs, block: str) -> ModelArgs:
    """`args` reading the store with the flow's `storage_credentials` block where it names none
    of its own."""
    if args.storage_credentials or not block:
        return args
    return args.model_copy(update={"storage_credentials": block})


def run_name() -> str:
    compressed = ModelArgs.model_validate(current_parameters()["compressed"])
    return f"evaluate {Path(compressed.model_id).name}"


@flow(name="evaluate-model", persist_result=True, flow_run_name=run_name)
def evaluate(
    compressed: ModelArgs,
    base: ModelArgs | None = None,
    held_out: HeldOutArgs = HeldOutArgs(),
    gate: QualityGate = QualityGate(),
    lm_eval: LmEvalArgs = LmEvalArgs(),
    served: ServedArgs = ServedArgs(),
    tracking: TrackingArgs = TrackingArgs(),
    compressed_by: str = "",
    engine: Literal["transformers", "vllm"] = "transformers",
    storage_credentials: str = "",
) -> EvaluationReport:
    """Score `compressed` against `base` on held-out text and apply the quality gate.

    Args:
        compressed: The compressed model: the folder compress-model published, the s3:// or
            file:// prefix it uploaded it to (output.upload_uri), or its ClearML id.
        base: The model it was compressed from; empty: the one its manifest records.
        held_out: Text both models read; calibration samples are left out of it.
        gate: Limits on the quality lost and, if asked, on the served speed (min_speedup);
            passing one fails or flags the run.
        lm_eval: lm-eval-harness tasks run on both models (optional).
        served: Served speed and memory of both models in vLLM, on one stated workload (on by
            default; "not measured here", with the reason, where the worker has no vLLM or
            its build cannot serve the scheme).
        tracking: Where the run is logged in ClearML.
        compressed_by: Id of the compress-model flow run that published `compressed` (the
            trigger fills it); the two runs then link to each other.
        engine: What scores both models: transformers, or vLLM (the server users deploy to;
            needs the worker's vLLM environment, and reports no KL divergence).
        storage_credentials: Name of a prefect-aws AwsCredentials block (never a key) for an
            s3:// `compressed` or `base` whose own storage_credentials is empty; empty: the
            worker's environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).
    """
    check_settings()  # the worker's environment, before anything is opened or started
    block = block_name(storage_credentials, "storage_credentials")
    compressed = with_credentials(compressed, block)
    check_lm_eval(lm_eval)
    require_vllm("engine", engine == "vllm", "set engine to transformers")
    base = base and with_credentials(base, block)
    if base is not None and is_store_uri(base.model_id):  # before the compressed model downloads
        check_source(base.model_id, base.storage_credentials, "base.model_id")
    compressed_path = resolve_compressed(compressed)
    manifest = read_manifest(compressed_path)
    recorded = manifest.base_model_args() if manifest and base is None else None
    # A manifest is a file in a folder anyone may have made (outputs are shared on the hub with
    # theirs): it may name the base, never have code run to load it.
    if recorded is not None and recorded.trust_remote_code:
        raise InputError(
            "base",
            f"the manifest of {compressed.model_id} names its base model {recorded.model_id} "
            "with trust_remote_code: true, and evaluate-model runs no code a file it reads asks "
            "for",
            "pass base.model_id yourself, with base.trust_remote_code: true if you trust that "
            "model's code",
        )
    base = base or (recorded and with_credentials(recorded, block))
    if base is None:
        raise InputError(
            "base",
            f"{compressed.model_id} has no compressflow manifest naming its base model",
            "pass base.model_id (the model it was compressed from)",
        )
    scheme = manifest.result.scheme if manifest else None
    inputs = {
        "compressed": compressed.model_dump(),
        "base": base.model_dump(),
        "held_out": held_out.model_dump(),
        "gate": gate.model_dump(),
        "lm_eval": lm_eval.model_dump(),
        "served": served.model_dump(),
        "engine": {"engine": engine},
    }
    stages = Stages(timeout_fields={run_lm_eval.name: "lm_eval.timeout_minutes"})
    with opened(
        "evaluate-model",
        tracking,
        f"evaluate {compressed_path.name}",
        ["evaluation", scheme or "custom"],
        inputs,
    ) as tracker:
        fetched = stages.run(fetch_model, base)
        text = stages.run(
            build_held_out,
            held_out.dataset_args(),
            fetched,
            manifest.calibration_args() if manifest else None,
        )
        if compressed_by:
            link_runs(compressed_by, evaluation_key(base, manifest))
        # Lineage on the Assets page: the checkpoint feeds its evaluation.
        compare = materializing(
            compare_models,
            evaluation_asset(compressed_path),
            [checkpoint_asset(compressed_path, scheme or "custom")],
            by="compressflow",
        )
        metrics = stages.run(compare, fetched, str(compressed_path), text, engine)
        scores = lm_eval_scores(stages, lm_eval, fetched, compressed_path, text)
        recovered = recovery(scores["base"], scores["compressed"]) if scores else {}
        performance = (
            stages.run(measure_served, fetched, str(compressed_path), text, served)
            if served.measure
            else None
        )
        speed = judge_speed(performance, gate.min_speedup)
        found = (
            breaches(metrics, gate.max_perplexity_increase_pct, gate.max_kl)
            + recovery_breaches(recovered, gate.min_lm_eval_recovery_pct)
            + speed.breaches
        )
        report = EvaluationReport(
            compressed_path=str(compressed_path),
            base_identity=fetched.identity,
            scheme=scheme,
            held_out_source=text.source,
            excluded_calibration_samples=text.excluded_calibration_samples,
            metrics=metrics,
            lm_eval={which: scored.metrics for which, scored in scores.items()},
            lm_eval_backend=scores["base"].backend if scores else None,
            lm_eval_recovery=recovered,
            served=performance,
            breaches=found,
            flags=speed.flags,
            passed=not found,
        )
        publish_evaluation(
            tracker, report, gate, base.model_id, manifest and manifest.recipe["source"]
        )
    for flag in report.flags:
        run_logger(__name__).warning("Flagged, not failed: %s", flag)
    report.tracking = tracker.status()
    # Only the card of a folder given as a folder: a hub, ClearML or store copy is a cache.
    given_as_folder = not compressed.clearml_model and Path(compressed.model_id).exists()
    if given_as_folder and manifest is not None:
        record_evaluation(compressed_path, manifest, report, base.model_id, engine)
    elif is_store_uri(compressed.model_id):
        run_logger(__name__).info(
            "Recorded in the Prefect artifact and ClearML only: %s is not written back (its "
            "manifest and card stay as published; docs/evaluation.md)",
            compressed.model_id,
        )
    apply_gate(found, compressed_path, gate)
    return report


def record_evaluation(
    folder: Path, manifest: Manifest, report: EvaluationReport, base_id: str, engine: str
) -> None:
    """Write the evaluation into the card and manifest of the published folder it scored, under
    the folder's lock, and only while the folder still holds what was scored: a compress run
    that republished it meanwhile, or files changed since publishing, would otherwise get a
    manifest describing other weights. Only the folder of a manifest is written: a model we
    did not publish never is (and a hub or ClearML copy is a cache, not ours)."""
    log = run_logger(__name__)
    try:
        with output_lock(folder, log, timeout=RECORD_WAIT_SECONDS):
            current = read_manifest(folder)
            if current is None or current.created_at != manifest.created_at:
                log.warning(
                    "Not recorded in %s: it was published anew while this evaluation ran; the "
                    "figures above are of the earlier model",
                    folder,
                )
                return
            changed = changed_files(folder, current)
            if changed != []:
                log.warning(
                    "Not recorded in %s: %s, so its manifest may not describe the files scored",
                    folder,
                    "its manifest does not record the sha256 of each file"
                    if changed is None
                    else f"it changed since it was published ({'; '.join(changed[:3])})",
                )
                return
            if add_evaluation(folder, evaluation_section(report, base_id, engine)):
                log.info("Added the evaluation to %s", folder / CARD)
            # Beside the card: every figure, readable.
            replace_manifest(folder, current.model_copy(update={"evaluation": report}))
    except PublishError as exc:  # a compress run has held the folder since before the wait
        log.warning("Not recorded in %s: %s", folder, exc.problem)
    except OSError as exc:  # a folder this worker may read but not write: the scores stand
        log.warning("Not recorded in %s: %s", folder, exc)


def apply_gate(found: list[str], compressed_path: Path, gate: QualityGate) -> None:
    """Fail the run on a breach (gate.on_threshold 'fail'), or only warn ('flag')."""
    if not found:
        return
    slow = [breach for breach in found if breach.startswith(SPEED_BREACH)]
    lost = "lost too much quality" if len(slow) < len(found) else "serves slower than allowed"
    message = f"{compressed_path} {lost}: {'; '.join(found)}"
    if gate.on_threshold == "fail":
        quality_fix = (
            "use a gentler recipe (more calibration samples, a wider scheme) or, if the loss is "
            "acceptable, raise gate.max_perplexity_increase_pct / gate.max_kl, lower "
            "gate.min_lm_eval_recovery_pct"
        )
        fixes = ([quality_fix] if len(slow) < len(found) else []) + ([SPEED_FIX] if slow else [])
        raise QualityThresholdExceeded(
            "gate", message, "; ".join(fixes) + "; or set gate.on_threshold to flag"
        )
    run_logger(__name__).warning("Flagged: %s", message)
