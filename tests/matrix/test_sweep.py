"""sweep-recipe against a real server: points run as deployment runs on the process pool's worker.

The sweep itself runs in a subprocess with the stack's environment (it shares PREFECT_HOME, and so
the result storage, with the worker: that is how every point finds the shared fetch and dataset
in the cache and how the sweep reads each point's results).
"""

from __future__ import annotations

import json
import sys

from compressflow.results import Point
from compressflow.store.identity import point_key

SWEEP = """
import json, sys
from compressflow.flows.sweep import sweep
report = sweep(**json.loads(sys.argv[1]))
print("SWEEP_REPORT " + report.model_dump_json())
"""


def run_sweep(stack, **params) -> dict:
    out = stack.run(sys.executable, "-c", SWEEP, json.dumps(params), timeout=900)
    line = next(row for row in out.splitlines() if row.startswith("SWEEP_REPORT "))
    return json.loads(line.removeprefix("SWEEP_REPORT "))


def sweep_params(tiny_model, root, recipe_args) -> dict:
    return {
        "model": {"model_id": str(tiny_model)},
        "output_root": str(root),
        "dataset": {"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 64},
        "recipe": {"recipe": "W4A16"},
        "space": {"recipe_args": recipe_args},
        "objective": {"metric": "kl_divergence", "direction": "minimize"},
        "held_out": {"dataset_name": "python_docs", "samples": 8, "max_seq_len": 64},
    }


def task_run_states(client, name: str) -> dict[str, str]:
    """State names of the task runs called `name`, by run id (the API returns no fixed order)."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)))
    return {str(run.id): run.state.name for run in runs if run.name.startswith(name)}


def new_states(client, name: str, before: dict[str, str]) -> list[str]:
    return [
        state for run_id, state in task_run_states(client, name).items() if run_id not in before
    ]


def compress_run_count(client) -> int:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    return len(
        client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["compress-model"])))
    )


# Eight worker runs, about 110 s: a fifth of `make test`, which it pushed past its 8 minutes; it
# runs in `make matrix`, after `make test` in CI.
def test_a_grid_ranks_its_points_shares_fetch_and_dataset_and_a_rerun_finishes_a_failed_one(
    prefect_stack, stack_client, tiny_model, tmp_path
):
    """One sweep shows every sweep behaviour: a deployment run per point costs a worker process."""
    # A 3x1 grid: two axes crossed, two points to rank, one to fail (each point is a worker run).
    params = sweep_params(
        tiny_model, tmp_path, {"dampening_frac": [0.01, 0.1, 0.2], "block_size": [64]}
    )
    # Occupy one point's output folder: its compression is refused, the other points go on.
    failing = Point(recipe_args={"dampening_frac": 0.2, "block_size": 64}, text_samples=8)
    blocked = tmp_path / f"point-{point_key(failing)}"
    blocked.mkdir(parents=True)
    (blocked / "model.safetensors").write_text("somebody else's model")
    fetch_before = task_run_states(stack_client, "fetch model")
    build_before = task_run_states(stack_client, "build dataset")

    first = run_sweep(prefect_stack, **params)
    results = first["results"]
    points = [
        (r["point"]["recipe_args"]["dampening_frac"], r["point"]["recipe_args"]["block_size"])
        for r in results
    ]
    assert set(points) == {(0.01, 64), (0.1, 64), (0.2, 64)}
    assert [r["status"] for r in results] == ["completed"] * 2 + ["failed"]
    assert points[-1] == (0.2, 64) and "already holds" in results[-1]["error"]
    objectives = [r["objective"] for r in results[:2]]
    assert objectives == sorted(objectives), "completed rows are ranked by the objective"
    assert first["best"] == results[0]

    # Fetch and dataset build ran at most once (the sweep's own warm-up; not at all when an
    # earlier test of the session already did the same work); every point's runs hit the cache.
    fetch = new_states(stack_client, "fetch model", fetch_before)
    build = new_states(stack_client, "build dataset", build_before)
    assert fetch.count("Completed") <= 1 and fetch.count("Cached") >= 3, fetch
    assert build.count("Completed") <= 1 and build.count("Cached") >= 3, build

    (blocked / "model.safetensors").unlink()
    before = compress_run_count(stack_client)
    second = run_sweep(prefect_stack, **params)
    assert compress_run_count(stack_client) == before + 1, "only the failed point ran again"
    assert all(r["status"] == "completed" for r in second["results"])
