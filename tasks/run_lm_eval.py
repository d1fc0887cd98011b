"""lm-eval: runs lm-eval-harness tasks on a model, in a child process, within a time limit.

The Prefect face of the stage: the tasks, their refusals and the run live in
compressflow/evaluation/harness.py. `check_lm_eval` runs before any model loads; `write_own_tasks`
writes the project's offline tasks for the run; `run_lm_eval` scores one model (the flow calls
it for the base and for the compressed model) with the backend asked for: vLLM in the vLLM
environment (a subprocess of its own), or transformers in a child; lm-eval's log lines are its
progress.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.errors import InputError
from compressflow.evaluation.harness import (
    OWN_TASKS,
    decoded_texts,
    evaluate,
    evaluate_in_vllm,
    held_out_texts,
    hub_refusals,
    write_tasks,
)
from compressflow.logs import run_logger
from compressflow.params import LmEvalArgs
from compressflow.results import FetchedModel, HeldOutText, LmEvalScores
from compressflow.runtime.isolation import in_child


def check_lm_eval(args: LmEvalArgs) -> None:
    """Refuse, before any model loads, lm-eval tasks this worker cannot run: lm-eval missing,
    an unreadable held-out file, a task lm-eval does not know or that needs the hub on a worker
    without it."""
    if not args.tasks:
        return
    if importlib.util.find_spec("lm_eval") is None:
        raise InputError(
            "lm_eval.tasks",
            f"lm-eval tasks {args.tasks} were requested but lm-eval is not installed on this "
            "worker",
            "install the eval extra on the worker (pip install 'compressflow[eval]'), or leave "
            "lm_eval.tasks empty",
        )
    if args.held_out_file and any(t in OWN_TASKS for t in args.tasks):
        held_out_texts(Path(args.held_out_file))
    # lm-eval's task index and datasets' cache: read in a child, the flow's process stays light.
    in_child(hub_refusals, args.tasks, None)


def write_own_tasks(
    args: LmEvalArgs, folder: Path, base: FetchedModel, held_out: HeldOutText
) -> str | None:
    """The include_path holding our tasks for this run, written into `folder`, over
    `args.held_out_file`'s texts or else `held_out`'s (decoded with the base model's tokenizer);
    None when none of ours was asked for."""
    if not any(t in OWN_TASKS for t in args.tasks):
        return None
    if args.held_out_file:
        texts = held_out_texts(Path(args.held_out_file))
    else:
        texts = in_child(decoded_texts, base.path, held_out.input_ids, base.trust_remote_code)
    return str(write_tasks(texts, folder))


@task(name="lm-eval", cache_policy=NO_CACHE)
def run_lm_eval(
    which: str,
    path: str,
    model: FetchedModel,
    args: LmEvalArgs,
    include_path: str | None,
    backend: str,
) -> LmEvalScores:
    """lm-eval-harness `args.tasks` on the `which` model ('base' or 'compressed') at `path`,
    with `backend` ('vllm' or 'hf')."""
    log = run_logger(__name__)
    log.info("lm-eval (%s) on the %s model (%s): %s", backend, which, path, ", ".join(args.tasks))
    work = (path, model, args.tasks, args.limit or None, include_path)
    # Past lm_eval.timeout_minutes, Prefect's limit on this task (set by the flow) stops the
    # child, and vLLM's process is stopped by its own, the same: a TimeoutError either way,
    # which the flow's stage boundary turns into StageTimedOut naming the field.
    if backend == "vllm":
        scores = evaluate_in_vllm(*work, args.timeout_minutes * 60 or None)
    else:
        scores = in_child(evaluate, *work)
    log.info(
        "lm-eval on the %s model (backend %s, %.1f s): %s",
        which,
        scores.backend,
        scores.seconds,
        ", ".join(f"{name} {value:.4g}" for name, value in scores.metrics.items()),
    )
    return scores
