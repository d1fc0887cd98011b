"""Sweep point: one compress-model run and one evaluate-model run, as deployment runs.

A point is a cached task: a rerun of the same sweep returns the points that completed and runs
the rest; a point that fails raises, so it is never cached. Its types live here rather than in the
flow module: a worker loads flow files by path, and persisted results must unpickle in any process.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.deployments import run_deployment

from compressflow.errors import PointFailed
from compressflow.params import METRICS
from compressflow.results import EvaluationReport, Point, PointResult, PublishedModel


def completed_result(flow_run):
    """The result of a finished deployment run, or PointFailed saying how it ended."""
    state = flow_run.state
    if state is None or not state.is_completed():
        how = f"{state.name}: {(state.message or '').strip()}" if state else "without a state"
        raise PointFailed(
            "sweep point",
            f"{flow_run.name} ended {how}",
            "open that flow run for its error; rerunning the sweep retries only failed points",
        )
    return state.result()


@task(name="sweep point", cache_policy=INPUTS + TASK_SOURCE, persist_result=True)
def run_point(
    point: Point,
    compress_params: dict,
    held_out: dict,
    objective_metric: str,
    compress_deployment: str,
    evaluate_deployment: str,
) -> PointResult:
    """Compress and evaluate one point; raises PointFailed so the point stays uncached."""
    compress_run = run_deployment(
        compress_deployment, parameters=compress_params, timeout=None, as_subflow=True
    )
    published: PublishedModel = completed_result(compress_run)
    evaluate_run = run_deployment(
        evaluate_deployment,
        parameters={
            "compressed": {"model_id": published.path},
            "base": compress_params["model"],
            "held_out": held_out,
            # A sweep ranks points: record every point's metrics rather than failing on a gate.
            "gate": {"on_threshold": "flag"},
            # Nor the deployment's lm-eval tasks: no objective reads them, and they double a
            # point's evaluation.
            "lm_eval": {"tasks": []},
        },
        timeout=None,
        as_subflow=True,
    )
    report: EvaluationReport = completed_result(evaluate_run)
    metrics = report.metrics.model_dump()
    return PointResult(
        point=point,
        status="completed",
        metrics={name: float(metrics[name]) for name in METRICS},
        objective=float(metrics[objective_metric]),
        output_path=published.path,
        runs={"compress": compress_run.name, "evaluate": evaluate_run.name},
    )
