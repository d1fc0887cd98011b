"""Served performance: the base and the compressed model, each served by `vllm serve` with the
same flags in the vLLM environment, measured by vLLM's own benchmark (`vllm bench serve`).

First version of the interface (issue 58); the measurement follows.
"""

from __future__ import annotations

import random
from pathlib import Path

from compressflow.data.result import HeldOutText
from compressflow.evaluation.args import ServedArgs
from compressflow.evaluation.result import ServedPerformance
from compressflow.settings import settings


def prompt_windows(input_ids: list[list[int]], length: int) -> list[list[int]]:
    """Non-overlapping `length`-token windows cut from each text; where no text is that long,
    from the texts joined end to end."""
    windows = [
        ids[start : start + length]
        for ids in input_ids
        for start in range(0, len(ids) - length + 1, length)
    ]
    if windows:
        return windows
    joined = [token for ids in input_ids for token in ids]
    return [joined[start : start + length] for start in range(0, len(joined) - length + 1, length)]


def held_out_prompts(
    held_out: HeldOutText, tokenizer_path: str | Path, args: ServedArgs
) -> list[str]:
    """`args.prompts` prompts of `args.input_len` tokens cut from the held-out token ids, chosen
    by `args.seed` and decoded with the base model's tokenizer (loads transformers: run it in a
    child). Distinct where the texts allow, repeated where they are fewer."""
    from transformers import AutoTokenizer

    windows = prompt_windows(held_out.input_ids, args.input_len)
    if not windows:
        raise ValueError(
            f"the held-out texts hold {sum(map(len, held_out.input_ids))} tokens, fewer than "
            f"served.input_len ({args.input_len})"
        )
    random.Random(args.seed).shuffle(windows)
    chosen = windows[: args.prompts]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    texts = tokenizer.batch_decode(chosen, skip_special_tokens=True)
    return [texts[number % len(texts)] for number in range(args.prompts)]


def serve_and_measure(
    base: Path, compressed: Path, prompts: list[str], args: ServedArgs
) -> ServedPerformance:
    """Serve `base` and `compressed` with identical `vllm serve` flags and measure both with
    `vllm bench serve` on `prompts`; never raises for what vLLM says."""
    if settings().vllm_python_path() is None:
        return ServedPerformance(
            status="not measured here", reason=settings().vllm_missing_reason()
        )
    return ServedPerformance(status="failed", reason="not built yet")
