"""lm-eval-harness on a model: the project's own offline tasks, users' tasks, and the run itself.

lm-eval is how this field states what quantization cost, so evaluate-model runs it on the base and
the compressed model. Two tasks of our own are defined the way lm-eval defines tasks (a YAML over
local JSON-lines files, found through `TaskManager(include_path=...)`), built from held-out
texts (a file of {"text": ...} rows such as the yardstick's `held_out.jsonl`, or the texts the
evaluation already scores), so they run on a worker without the hub:

- `compressflow_code_perplexity`: word and byte perplexity of each text (loglikelihood_rolling);
- `compressflow_next_line`: which of four lines comes next after a text's first lines; the other
  three are lines of other texts. Built with a fixed seed: the same file gives the same questions.

Users' task names pass through to lm-eval unchanged. A task whose dataset lives on the hub is
refused on an offline worker before any model loads (`hub_refusals`), naming the task and the
fix, instead of failing minutes later in `datasets`.

Which backend runs: vLLM, the server users deploy to, where the worker's vLLM environment holds
lm-eval too (`make vllm-env` installs it there: lm-eval's vllm backend must run in vLLM's
Python, so `harness_vllm_child.py` runs there as a subprocess, as serving.py runs vllm_child.py);
else transformers ("hf") in the stage's child process (`evaluate`), over the model
`load_causal_lm` loads, the same loader, checks and reload patches the rest of evaluation uses.
The scores say which ran. lm-eval's own log lines go to the stage's log as progress.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from compressflow.errors import EvaluationError, InputError
from compressflow.evaluation.quality import load_causal_lm
from compressflow.logs import run_logger
from compressflow.model.serving import (
    child_environment,
    keep_compiled,
    kv_cache_dtype,
    last_error_lines,
    max_positions,
    too_slow_reason,
    vllm_python,
)
from compressflow.results import FetchedModel, HeldOutText, LmEvalScores
from compressflow.settings import settings

PERPLEXITY_TASK = "compressflow_code_perplexity"
NEXT_LINE_TASK = "compressflow_next_line"
OWN_TASKS = (PERPLEXITY_TASK, NEXT_LINE_TASK)
CHOICES = 4
MIN_LINE_CHARS = 12  # shorter lines (a bracket, `else:`) are guessable from shape alone
SEED = 0
# datasets' builders over local files: a task with one of these and local data_files is offline.
LOCAL_BUILDERS = {"json", "csv", "text", "parquet", "arrow", "pandas"}
HUB_PROBE_SECONDS = 3.0
NOT_SCORES = {"sample_len", "alias"}  # what lm-eval's results hold beside the metrics
VLLM_CHILD = Path(__file__).with_name("harness_vllm_child.py")
# vLLM reserves KV cache for its whole context: our texts are 128 tokens, few tasks pass 4096.
MAX_MODEL_LEN = 4096

# The YAMLs lm-eval reads; `{data}` is the JSON-lines file beside them.
TASK_YAML = {
    PERPLEXITY_TASK: """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
""",
    NEXT_LINE_TASK: """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
}


def held_out_texts(path: Path) -> list[str]:
    """The texts of a JSON-lines file of {"text": ...} rows; InputError when it holds none."""
    field = "lm_eval.held_out_file"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        texts = [json.loads(line)["text"] for line in lines if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(
            field,
            f"{path} is not a readable JSON-lines file of {{'text': ...}} rows ({exc})",
            "give a JSON-lines file with one {'text': ...} row per held-out text (the "
            "yardstick's held_out.jsonl is one)",
        ) from exc
    texts = [t for t in texts if isinstance(t, str) and t.strip()]
    if not texts:
        raise InputError(field, f"{path} holds no texts", "give a file with held-out texts")
    return texts


def full_lines(text: str) -> list[str]:
    """A text's lines without the last: held-out texts are cut at token edges, so the last line
    may be cut mid-way."""
    return text.split("\n")[:-1]


def next_line_docs(texts: list[str], seed: int = SEED) -> list[dict]:
    """One question per text that has a long enough line after at least one line of context:
    {"context", "choices", "gold"}. Deterministic for the same texts and seed."""
    rng = random.Random(seed)
    pool = sorted(
        {line for t in texts for line in full_lines(t) if len(line.strip()) >= MIN_LINE_CHARS}
    )
    docs = []
    for text in texts:
        lines = full_lines(text)
        candidates = [
            i
            for i in range(1, len(lines))
            if len(lines[i].strip()) >= MIN_LINE_CHARS  # and a context that says something:
            and len("".join(lines[:i]).strip()) >= MIN_LINE_CHARS
        ]
        if not candidates or len(pool) < 2 * CHOICES:
            continue
        at = rng.choice(candidates)
        answer = lines[at]
        own = {line.strip() for line in lines}
        distractors: list[str] = []
        while len(distractors) < CHOICES - 1:
            line = rng.choice(pool)
            if line.strip() not in own and line not in distractors:
                distractors.append(line)
        choices = distractors + [answer]
        rng.shuffle(choices)
        docs.append(
            {
                "context": "\n".join(lines[:at]) + "\n",
                "choices": choices,
                "gold": choices.index(answer),
            }
        )
    return docs


def decoded_texts(tokenizer: str, input_ids: list[list[int]], trust_remote_code: bool) -> list[str]:
    """The evaluation's held-out samples as text again (run in a child: it loads a tokenizer)."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    return loaded.batch_decode(input_ids, skip_special_tokens=True)


def write_tasks(texts: list[str], folder: Path) -> Path:
    """The project's tasks over `texts`, written into `folder` (their YAMLs and data): the
    include_path lm-eval's TaskManager is given."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        PERPLEXITY_TASK: [{"text": t} for t in texts],
        NEXT_LINE_TASK: next_line_docs(texts),
    }
    for task, rows in data.items():
        rows_file = folder / f"{task}.jsonl"
        rows_file.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        (folder / f"{task}.yaml").write_text(
            TASK_YAML[task].format(task=task, data=json.dumps(str(rows_file))), encoding="utf-8"
        )
    return folder


def hub_offline_reason() -> str | None:
    """Why this worker cannot reach the Hugging Face hub; None when it can."""
    from huggingface_hub import constants

    # Read now: huggingface_hub's constant is the forkserver's environment at its start.
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return "HF_HUB_OFFLINE is set"
    import requests

    try:
        requests.head(constants.ENDPOINT, timeout=HUB_PROBE_SECONDS)
    except requests.RequestException as exc:
        return f"{constants.ENDPOINT} is unreachable ({type(exc).__name__})"
    return None


def dataset_paths(manager, name: str, seen: set[str] | None = None) -> list[str]:
    """The dataset_path of every task `name` stands for (a task, or a group's or tag's tasks)."""
    seen = seen if seen is not None else set()
    if name in seen or (entry := manager.task_index.get(name)) is None:
        return []
    seen.add(name)
    config = entry.cfg or {}
    kind = entry.kind.name  # by name: lm-eval's Kind enum lives in a private module
    if kind in ("GROUP", "TAG"):
        # A tag's entry lists its tasks in `tags`; a group's are names or inline configs.
        members = entry.tags if kind == "TAG" else config.get("task") or []
        found = []
        for member in members:
            if isinstance(member, dict):
                found += [member["dataset_path"]] if "dataset_path" in member else []
                member = member.get("task")
            if isinstance(member, str):
                found += dataset_paths(manager, member, seen)
        return found
    path = config.get("dataset_path")
    return [path] if isinstance(path, str) else []


def on_hub(dataset_path: str) -> bool:
    """Whether a task's dataset comes from the hub and is not in this worker's datasets cache."""
    if dataset_path in LOCAL_BUILDERS or Path(dataset_path).expanduser().exists():
        return False
    from datasets import config

    cached = Path(config.HF_DATASETS_CACHE) / dataset_path.replace("/", "___")
    return not cached.exists()


def hub_refusals(tasks: list[str], include_path: Path | None) -> None:
    """InputError for the first of `tasks` lm-eval does not know, or that needs the hub on a
    worker that cannot reach it; before any model loads."""
    users = [t for t in tasks if t not in OWN_TASKS]
    if not users:
        return
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path) if include_path else None)
    offline = None
    for task in users:
        if task not in manager.task_index:
            raise InputError(
                "lm_eval.tasks",
                f"lm-eval {manager_version()} has no task, group or tag named {task!r}",
                f"use a name `lm_eval ls tasks` lists, or one of ours: {', '.join(OWN_TASKS)}",
            )
        needs = [p for p in dataset_paths(manager, task) if on_hub(p)]
        if needs and (offline := offline or hub_offline_reason()):
            raise InputError(
                "lm_eval.tasks",
                f"lm-eval task {task!r} reads {needs[0]} from the Hugging Face hub, and this "
                f"worker cannot reach it ({offline})",
                "run it on a worker with hub access, or fill the worker's datasets cache "
                f"(HF_HOME) once where the hub is reachable; offline, use {NEXT_LINE_TASK} and "
                f"{PERPLEXITY_TASK}",
            )


def manager_version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


class _Progress(logging.Handler):
    """lm-eval's log records, re-logged on this module's logger, which reaches the run's log."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(__name__).log(record.levelno, "lm-eval: %s", record.getMessage())


def metrics_of(results: dict) -> tuple[dict[str, float], dict[str, bool]]:
    """{'<task>/<metric>': value} and which of them are better higher, from lm-eval's results;
    standard errors are left out (a figure of their own, not a score)."""
    values, higher = {}, {}
    for task, found in results["results"].items():
        better = results.get("higher_is_better", {}).get(task, {})
        for key, value in found.items():
            metric = key.split(",", 1)[0]  # "acc,none": the metric and its filter
            if metric in NOT_SCORES or "stderr" in metric or not isinstance(value, int | float):
                continue
            values[f"{task}/{metric}"] = float(value)
            higher[f"{task}/{metric}"] = bool(better.get(metric, True))
    return values, higher


def evaluate(
    path: str,
    model: FetchedModel,
    tasks: list[str],
    limit: int | None,
    include_path: str | None,
) -> LmEvalScores:
    """lm-eval's `tasks` on the checkpoint at `path` (the base, or its compressed copy), with the
    transformers backend; run in the stage's child."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    progress = _Progress(logging.INFO)
    logging.getLogger("lm_eval").addHandler(progress)
    # Its warning that a loaded model ignores model_args: we pass none, loading it ourselves.
    logging.getLogger("lm_eval.models.huggingface").setLevel(logging.ERROR)
    started = time.perf_counter()
    try:
        loaded = load_causal_lm(path, model.model_class, model.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(
            model.path, trust_remote_code=model.trust_remote_code
        )
        results = lm_eval.simple_evaluate(
            model=HFLM(pretrained=loaded, tokenizer=tokenizer, batch_size=8),
            tasks=tasks,
            limit=limit,
            # lm-eval's own tasks are indexed only when asked for: about 7 s of YAML walking.
            task_manager=TaskManager(
                include_path=include_path,
                include_defaults=any(t not in OWN_TASKS for t in tasks),
            ),
            log_samples=False,
            random_seed=SEED,
            numpy_random_seed=SEED,
            torch_random_seed=SEED,
            fewshot_random_seed=SEED,
        )
    finally:
        logging.getLogger("lm_eval").removeHandler(progress)
    values, higher = metrics_of(results)
    return LmEvalScores(
        backend="hf",
        lm_eval_version=manager_version(),
        metrics=values,
        higher_is_better=higher,
        seconds=round(time.perf_counter() - started, 3),
    )


def recovery(base: LmEvalScores, compressed: LmEvalScores) -> dict[str, float]:
    """Per metric both models have: the compressed model's score as a percent of the base's,
    inverted for metrics better lower (perplexities), so 100 is no loss and less is worse."""
    found = {}
    for name, value in compressed.metrics.items():
        before = base.metrics.get(name)
        if before and value and math.isfinite(before) and math.isfinite(value):
            ratio = (
                value / before if compressed.higher_is_better.get(name, True) else before / value
            )
            found[name] = 100.0 * ratio
    return found


def recovery_breaches(recovered: dict[str, float], min_recovery_pct: float) -> list[str]:
    """One line per lm-eval metric that recovered less than `min_recovery_pct` (0: no limit)."""
    return [
        f"lm-eval {name} recovered {pct:.2f}% of the base model's (limit {min_recovery_pct}%)"
        for name, pct in recovered.items()
        if min_recovery_pct and not pct >= min_recovery_pct
    ]


@functools.cache
def vllm_has_lm_eval(python: Path) -> bool:
    """Whether the vLLM environment at `python` can import lm-eval (without importing it)."""
    script = "import importlib.util, sys; sys.exit(importlib.util.find_spec('lm_eval') is None)"
    try:
        return subprocess.run([str(python), "-c", script], timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def backend(compressed: Path, held_out: HeldOutText, timeout_minutes: float) -> str:
    """'vllm' where the worker's vLLM environment holds lm-eval and can score the `compressed`
    checkpoint's held-out tokens within lm-eval's time limit (or, with none, vLLM's check's), as
    far as is known before it starts (serving.too_slow_reason); else 'hf' (transformers)."""
    python = vllm_python()
    if python is None or not vllm_has_lm_eval(python):
        return "hf"
    budget = timeout_minutes * 60 or settings().vllm_timeout_seconds
    tokens = sum(map(len, held_out.input_ids))  # our tasks score each at least once
    if slow := too_slow_reason(compressed, tokens, budget, python):
        run_logger(__name__).warning("lm-eval runs on transformers: %s", slow)
        return "hf"
    return "vllm"


def evaluate_in_vllm(
    path: str,
    model: FetchedModel,
    tasks: list[str],
    limit: int | None,
    include_path: str | None,
    timeout: float | None,
) -> LmEvalScores:
    """lm-eval's `tasks` on the checkpoint at `path` with its vLLM backend, in the vLLM
    environment; lm-eval's log lines are logged as they come. TimeoutError past `timeout`
    seconds; EvaluationError, with vLLM's last words, when it scores nothing."""
    python = vllm_python()
    folder = Path(path).resolve()
    started = time.perf_counter()
    log = logging.getLogger(__name__)
    with tempfile.TemporaryDirectory(prefix="compressflow-lm-eval-") as work:
        request, result = Path(work, "request.json"), Path(work, "result.json")
        model_args = {
            "pretrained": str(folder),
            "dtype": "bfloat16",  # as vllm_child.py serves it
            "max_model_len": min(max_positions(folder), MAX_MODEL_LEN),
            "kv_cache_dtype": kv_cache_dtype(folder),
            "enforce_eager": True,
            "trust_remote_code": model.trust_remote_code,
        }
        request.write_text(
            json.dumps(
                {
                    "model_args": model_args,
                    "tasks": tasks,
                    "limit": limit,
                    "include_path": include_path,
                    "include_defaults": any(t not in OWN_TASKS for t in tasks),
                    "seed": SEED,
                }
            )
        )
        env = child_environment(Path(work))
        # Users' tasks read their datasets from the hub where the worker may reach it.
        env["HF_HUB_OFFLINE"] = os.environ.get("HF_HUB_OFFLINE", "0")
        process = subprocess.Popen(
            [str(python), str(VLLM_CHILD), str(request), str(result)],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # stopping it stops vLLM's helpers too
        )
        expired = threading.Event()

        def stop() -> None:
            expired.set()
            os.killpg(process.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, stop) if timeout else None
        if timer:
            timer.start()
        tail: deque[str] = deque(maxlen=40)
        try:
            for line in process.stderr:
                tail.append(line)
                if line.startswith("lm_eval"):
                    log.info("lm-eval (vLLM): %s", line.rstrip())
            process.wait()
        finally:
            if timer:
                timer.cancel()
        if expired.is_set():
            raise TimeoutError(f"lm-eval's vLLM backend ran past {timeout:.0f} s")
        if process.returncode == 0:
            keep_compiled(Path(work))
        found = json.loads(result.read_text()) if result.exists() else None
    if found is None:
        raise EvaluationError(
            "lm_eval.tasks",
            f"lm-eval's vLLM backend did not score {folder}: {last_error_lines(''.join(tail))}",
            "set COMPRESSFLOW_VLLM_PYTHON to a vLLM environment that serves this model, or to "
            "off for the transformers backend",
        )
    values, higher = metrics_of(found)
    return LmEvalScores(
        backend="vllm",
        lm_eval_version=manager_version(),
        metrics=values,
        higher_is_better=higher,
        seconds=round(time.perf_counter() - started, 3),
    )
