"""lm-eval: the project's offline tasks as lm-eval reads them, refusals before any model loads,
and recovery figures, lm-eval's and verify's (compressflow/evaluation/harness.py,
tasks/run_lm_eval.py, compressflow/evaluation/quality.py). A hub task's refusal reads lm-eval's
whole task index (6 to 12 s): tests/matrix/test_lm_eval_hub_tasks.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from compressflow.errors import InputError
from compressflow.evaluation.harness import (
    NEXT_LINE_TASK,
    OWN_TASKS,
    PERPLEXITY_TASK,
    held_out_texts,
    metrics_of,
    next_line_docs,
    recovery,
    recovery_breaches,
    write_tasks,
)
from compressflow.params import LmEvalArgs
from compressflow.results import LmEvalScores
from compressflow.tasks.run_lm_eval import check_lm_eval

# Held-out code as the yardstick cuts it: windows of a file, the last line cut mid-way.
TEXTS = [
    "def parse(value):\n    tokens = value.split(',')\n    return [t.strip() for t in tokens]\n  ret",
    "class Reader:\n    def __init__(self, stream):\n        self.stream = stream\n    def re",
    "import os\nfor name in sorted(os.listdir(folder)):\n    print(name.upper(), end=' ')\nx",
    "while queue:\n    item = queue.popleft()\n    results.append(handle(item))\ndone",
    "try:\n    value = int(text)\nexcept ValueError:\n    value = default_value\nfin",
]


def held_out(tmp_path: Path) -> Path:
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def test_next_line_questions_are_deterministic_and_hold_the_true_next_line():
    docs = next_line_docs(TEXTS)
    assert docs == next_line_docs(TEXTS) and docs != next_line_docs(TEXTS, seed=1)
    assert len(docs) == len(TEXTS)
    for text, doc in zip(TEXTS, docs, strict=True):
        assert len(set(doc["choices"])) == 4
        answer = doc["choices"][doc["gold"]]
        assert text.startswith(doc["context"] + answer + "\n")
        # The wrong three come from other texts, never from this one.
        assert all(c not in text for i, c in enumerate(doc["choices"]) if i != doc["gold"])


def test_written_tasks_load_in_lm_eval_without_its_own_tasks(tmp_path):
    from lm_eval.tasks import TaskManager

    folder = write_tasks(held_out_texts(held_out(tmp_path)), tmp_path / "tasks")
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    assert set(OWN_TASKS) <= set(manager.all_subtasks)
    loaded = manager.load(list(OWN_TASKS))["tasks"]
    rolling, choice = loaded[PERPLEXITY_TASK], loaded[NEXT_LINE_TASK]
    assert rolling.OUTPUT_TYPE == "loglikelihood_rolling"
    assert [rolling.doc_to_target(d) for d in rolling.test_docs()] == TEXTS
    assert choice.OUTPUT_TYPE == "multiple_choice" and len(choice.test_docs()) == len(TEXTS)


def test_a_held_out_file_without_texts_is_refused(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"sentence": "no text key"}\n')
    with pytest.raises(InputError, match="JSON-lines file"):
        check_lm_eval(
            LmEvalArgs(tasks=[PERPLEXITY_TASK], held_out_file=str(tmp_path / "bad.jsonl"))
        )


def scores(**metrics: float) -> LmEvalScores:
    return LmEvalScores(
        backend="hf",
        lm_eval_version="0.4.13",
        metrics=metrics,
        higher_is_better={name: "perplexity" not in name for name in metrics},
        seconds=1.0,
    )


def test_recovery_inverts_metrics_better_lower_and_the_gate_holds_a_minimum():
    base = scores(**{"t/acc": 0.5, "t/word_perplexity": 10.0})
    compressed = scores(**{"t/acc": 0.45, "t/word_perplexity": 12.5})
    recovered = recovery(base, compressed)
    assert recovered == pytest.approx({"t/acc": 90.0, "t/word_perplexity": 80.0})
    assert recovery_breaches(recovered, 0) == []
    assert recovery_breaches(recovered, 85) == [
        "lm-eval t/word_perplexity recovered 80.00% of the base model's (limit 85%)"
    ]


def test_metrics_leave_out_standard_errors_and_sample_counts():
    results = {
        "results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "sample_len": 8}},
        "higher_is_better": {"t": {"acc": True}},
    }
    assert metrics_of(results) == ({"t/acc": 0.5}, {"t/acc": True})


def test_verify_logits_give_both_models_perplexity_on_the_verified_tokens():
    import torch

    from compressflow.evaluation.quality import compare_logits

    ids = [[0, 1, 2], [2, 0]]
    base = [torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0]]), torch.zeros(2, 3)]
    flat = [torch.zeros(3, 3), torch.zeros(2, 3)]  # every token 1/3: perplexity 3
    figures = compare_logits(base, flat, ids)
    assert figures["compressed_perplexity"] == pytest.approx(3.0)
    nll = -2 * torch.log_softmax(torch.tensor([0.0, 2.0, 0.0]), 0)[1] + math.log(3)
    assert figures["base_perplexity"] == pytest.approx(math.exp(nll.item() / 3))
    assert "base_perplexity" not in compare_logits(base, flat)


def test_lm_eval_past_its_time_limit_names_the_field_and_what_less_means():
    from compressflow.errors import StageTimedOut
    from compressflow.runtime.stages import boundary

    with pytest.raises(StageTimedOut) as caught:
        with boundary("lm-eval", "lm_eval.timeout_minutes"):
            raise TimeoutError("Scope timed out after 0.6 second(s).")  # as Prefect raises it
    assert caught.value.field == "lm_eval.timeout_minutes"
    assert "a smaller lm_eval.limit" in caught.value.fix
