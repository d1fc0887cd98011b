"""Scores checkpoints with vLLM: run by the vLLM environment's Python, never imported by the flow.

    <vllm python> vllm_child.py REQUEST.json RESULT.json

The vLLM environment is not the flow's (vLLM pins its own compressed-tensors and torch, as a
serving image does), so this file imports only vLLM and the standard library, and talks through
two JSON files. REQUEST holds `models` ({name: {"path": folder, "prompts": token id lists,
"kv_cache_dtype": vLLM's, auto when absent}}) and `trust_remote_code`. For each model, in order,
RESULT gets either `positions` (per prompt, per next-token position: `[log-probability of the
actual token, the most likely token]`) or `error`: the innermost exception's type and message,
which is vLLM's root cause rather than its wrapper's "Engine core initialization failed",
followed by the last exception vLLM logged, where the error points to vLLM's log (a model class
that does not import, e.g. without torchvision).

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller): starting
two engines here takes seconds, a separate engine process per model takes tens of seconds on CPU.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time

# pydantic's last line of every validation error: a link, not the cause.
BOILERPLATE = "For further information visit"
# What vLLM raises when the cause is in its log only.
CHECK_THE_LOGS = "check the logs"


def one_line(exc: BaseException) -> str:
    """An exception's type and the last line of its message."""
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    message = [line for line in lines if line and not line.startswith(BOILERPLATE)]
    return f"{type(exc).__name__}: {message[-1] if message else ''}".strip()


def root_cause(exc: BaseException) -> str:
    """The innermost exception of the chain, one line: what actually went wrong."""
    seen = set()
    while id(exc) not in seen and (exc.__cause__ or exc.__context__):
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return one_line(exc)


class LoggedError(logging.Handler):
    """The last exception vLLM logged rather than raised. Some root causes only reach the log:
    a model class that does not import is logged (its traceback, from a subprocess, is the
    logged exception's message), then vLLM raises "failed to be inspected. Please check the
    logs"."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.last: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.last = record.exc_info[1]


def score(path: str, prompts: list[list[int]], kv_cache_dtype: str, request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=path,
        tokenizer=path,
        dtype=request.get("dtype", "bfloat16"),
        max_model_len=max(map(len, prompts)) + 1,
        enforce_eager=True,
        max_logprobs=1,
        seed=0,
        kv_cache_dtype=kv_cache_dtype,
        trust_remote_code=request.get("trust_remote_code", False),
    )
    loaded = time.perf_counter() - started
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0),
        use_tqdm=False,
    )
    positions = [
        [
            [options[token].logprob, max(options, key=lambda t: options[t].logprob)]
            for token, options in zip(
                output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True
            )
        ]
        for output in outputs
    ]
    del llm
    gc.collect()
    return {
        "positions": positions,
        "load_seconds": round(loaded, 3),
        "seconds": round(time.perf_counter() - started, 3),
    }


def main(request_path: str, result_path: str) -> None:
    # vLLM's own logging set-up (when an engine starts) drops every handler added before it;
    # without it, vLLM's warnings and errors go to stderr, which the caller reads.
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    import vllm

    request = json.loads(open(request_path).read())
    result = {"vllm_version": vllm.__version__, "models": {}}
    logged = LoggedError()
    logging.getLogger("vllm").addHandler(logged)
    for name, model in request["models"].items():
        try:
            kv_cache_dtype = model.get("kv_cache_dtype", "auto")
            result["models"][name] = score(model["path"], model["prompts"], kv_cache_dtype, request)
        except Exception as exc:  # noqa: BLE001 - every refusal is reported, the next model runs
            error = root_cause(exc)
            # Kept across models: vLLM remembers a model class that failed, and for the next
            # model of that architecture raises the same pointer to its log without logging.
            if CHECK_THE_LOGS in error and logged.last is not None:
                error += f" (vLLM's log: {one_line(logged.last)})"
            result["models"][name] = {"error": error}
        with open(result_path, "w") as handle:  # written as it goes: a crash keeps what was done
            json.dump(result, handle)


if __name__ == "__main__":  # vLLM may spawn workers, which re-import this file
    main(sys.argv[1], sys.argv[2])
