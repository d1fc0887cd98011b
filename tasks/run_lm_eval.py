"""lm-eval: runs lm-eval-harness tasks on a model, when the worker has lm-eval installed."""

from __future__ import annotations

import importlib.util

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.errors import InputError


def check_lm_eval(tasks: list[str]) -> None:
    """Fail before any model loads when lm-eval tasks are asked for but lm-eval is missing."""
    if tasks and importlib.util.find_spec("lm_eval") is None:
        raise InputError(
            "lm_eval.tasks",
            f"lm-eval tasks {tasks} were requested but lm-eval is not installed on this worker",
            "pip install lm-eval on the worker, or leave lm_eval.tasks empty",
        )


@task(name="lm-eval", cache_policy=NO_CACHE)
def run_lm_eval(
    path: str, tasks: list[str], limit: int | None, trust_remote_code: bool
) -> dict[str, float]:
    """lm-eval-harness `tasks` on the model at `path`: {'<task>/<metric>': value}."""
    import lm_eval

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": path, "trust_remote_code": trust_remote_code},
        tasks=tasks,
        limit=limit,
    )
    return {
        f"{name}/{metric}": float(value)
        for name, values in results["results"].items()
        for metric, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
