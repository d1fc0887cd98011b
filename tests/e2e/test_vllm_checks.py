"""Serving in vLLM in the flow, what `make test` runs: the refusals when vLLM is required but
missing. Serving itself (vLLM starts in 40 to 70 s here) is `make matrix`'s:
tests/matrix/test_vllm_served_runs.py (the shared run served once vLLM is there, outputs vLLM
refuses) and tests/matrix/test_mixed_precision_yardstick.py (a fresh run that verify serves).
The unit tests, with real subprocess children: tests/unit/test_vllm_serving.py.
"""

from __future__ import annotations

import pytest

from compressflow.errors import InputError
from compressflow.params import VerifyArgs


def test_required_vllm_is_refused_before_any_work(
    monkeypatch, tiny_model, tmp_path, prefect_harness
):
    from compressflow.flows.compress import compress

    monkeypatch.setenv("COMPRESSFLOW_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(InputError) as raised:
        compress(
            model={"model_id": str(tiny_model)},
            output={"save_directory": str(tmp_path / "out")},
            verify=VerifyArgs(vllm="required"),
        )
    message = str(raised.value)
    assert "verify.vllm" in message and "make vllm-env" in message
    assert not (tmp_path / "out").exists()


def test_evaluating_with_vllm_without_it_is_refused_first(w4a16_run, monkeypatch):
    from compressflow.flows.evaluate import evaluate
    from compressflow.params import ModelArgs

    monkeypatch.setenv("COMPRESSFLOW_VLLM_PYTHON", "off")
    with pytest.raises(InputError, match="engine needs vLLM"):
        evaluate(compressed=ModelArgs(model_id=w4a16_run.published.path), engine="vllm")
