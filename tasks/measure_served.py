"""Served performance: the base and the compressed model served by vLLM with the same flags and
measured with vLLM's own benchmark, `vllm bench serve` (the work lives in
compressflow/evaluation/served.py; reporting it is the flow's). Logs the workload, the device,
backend and kernels, and each level's figures."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.evaluation.served import held_out_prompts, no_vllm_here, serve_and_measure
from compressflow.logs import run_logger
from compressflow.params import ServedArgs
from compressflow.results import FetchedModel, HeldOutText, ServedPerformance
from compressflow.runtime.isolation import in_child


@task(name="served performance", cache_policy=NO_CACHE)
def measure_served(
    base: FetchedModel, compressed_path: str, held_out: HeldOutText, args: ServedArgs
) -> ServedPerformance:
    """Serve the base and the compressed model in vLLM with identical flags and measure output
    throughput and latency on prompts cut from the held-out texts; never raises for what vLLM
    says (the status and reason say it)."""
    log = run_logger(__name__)
    if missing := no_vllm_here():  # before a child loads the tokenizer for prompts never sent
        log.warning("served performance not measured here: %s", missing.reason)
        return missing
    try:
        # The tokenizer loads in a child: the task's process never imports transformers.
        prompts = in_child(held_out_prompts, held_out, base.path, args)
    except ValueError as error:  # too little held-out text for one prompt
        log.warning("served performance not measured: %s", error)
        return ServedPerformance(status="failed", reason=str(error))
    log.info(
        "served performance: %d prompts of %d tokens, %d generated each, concurrency %s, "
        "%d repeats interleaved base / compressed, seed %d; stops after %g minutes",
        len(prompts),
        args.input_len,
        args.output_len,
        args.concurrency,
        args.repeats,
        args.seed,
        args.timeout_minutes,
    )
    served = serve_and_measure(Path(base.path), Path(compressed_path), prompts, args)
    if served.status != "measured":
        log.warning(
            "served performance %s (%.0f s): %s", served.status, served.seconds, served.reason
        )
        return served
    log.info(
        "served on %s, %s, flags %s; kernels: base %s, compressed %s",
        served.device,
        served.backend,
        " ".join(served.serve_flags),
        served.kernels.get("base", "not named"),
        served.kernels.get("compressed", "not named"),
    )
    for level in served.levels:
        base_tps, tps = level.base["output_throughput"], level.compressed["output_throughput"]
        log.info(
            "concurrency %d: output %.1f tokens/s (%.1f-%.1f) against the base's %.1f "
            "(%.1f-%.1f), x%.2f, %s; TTFT p50 %.1f ms against %.1f",
            level.concurrency,
            tps.median,
            tps.low,
            tps.high,
            base_tps.median,
            base_tps.low,
            base_tps.high,
            level.throughput_ratio,
            level.verdict,
            level.compressed["ttft_p50"].median,
            level.base["ttft_p50"].median,
        )
    log.info("served performance measured in %.0f s", served.seconds)
    return served
