"""Served performance: the base and the compressed model served by vLLM with the same flags and
measured with `vllm bench serve` (compressflow/evaluation/served.py holds the work)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.evaluation.served import held_out_prompts, serve_and_measure
from compressflow.logs import run_logger
from compressflow.params import ServedArgs
from compressflow.results import FetchedModel, HeldOutText, ServedPerformance
from compressflow.runtime.isolation import in_child


@task(name="served performance", cache_policy=NO_CACHE)
def measure_served(
    base: FetchedModel, compressed_path: str, held_out: HeldOutText, args: ServedArgs
) -> ServedPerformance:
    """Serve the base and the compressed model in vLLM with identical flags and measure output
    throughput and latency on prompts cut from the held-out texts."""
    log = run_logger(__name__)
    prompts = in_child(held_out_prompts, held_out, base.path, args)
    log.info(
        "served performance: %d prompts of %d tokens, %d out, concurrency %s, %d repeats",
        len(prompts),
        args.input_len,
        args.output_len,
        args.concurrency,
        args.repeats,
    )
    served = serve_and_measure(Path(base.path), Path(compressed_path), prompts, args)
    log.info("served performance: %s %s", served.status, served.reason)
    return served
