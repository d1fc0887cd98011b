"""A task of lm-eval's own that reads the hub, named on a worker that cannot reach it: refused
before any model loads, naming the task and the fix. Here, not in tests/unit: the check reads
lm-eval's whole task index (about 14,700 entries, 6 to 12 s on two cores)."""

from __future__ import annotations

import pytest

from compressflow.errors import InputError
from compressflow.evaluation.harness import NEXT_LINE_TASK
from compressflow.params import LmEvalArgs
from compressflow.tasks.run_lm_eval import check_lm_eval


def test_a_hub_task_on_an_offline_worker_is_refused_naming_it_and_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError) as caught:
        check_lm_eval(LmEvalArgs(tasks=["hellaswag"]))
    error = caught.value
    assert error.field == "lm_eval.tasks"
    assert "'hellaswag' reads Rowan/hellaswag from the Hugging Face hub" in str(error)
    assert "HF_HUB_OFFLINE" in str(error) and NEXT_LINE_TASK in error.fix
