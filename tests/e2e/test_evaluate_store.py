"""evaluate-model on a compressed model given by the URI it was uploaded to, as the published
event's `upload_uri` hands it to an evaluation on another host: downloaded from the store into the
worker's cache, verified against its manifest, scored as the folder would be, the store left as
published. The session's one shared W4A16 compression (conftest's `w4a16_run`) is what it scores.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from compressflow.flows.evaluate import evaluate
from compressflow.params import HeldOutArgs, ModelArgs, ServedArgs
from compressflow.store.objects import commit_folder, open_store

pytestmark = pytest.mark.usefixtures("prefect_harness")

FEW = HeldOutArgs(samples=8, max_seq_len=128)


def test_a_compressed_model_is_evaluated_from_its_upload_uri(w4a16_run, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path / "worker-cache"))
    uri = f"file://{tmp_path}/store/tiny-w4a16"
    commit_folder(Path(w4a16_run.published.path), uri)
    store = open_store(uri)
    before = store.list()

    report = evaluate(
        compressed=ModelArgs(model_id=uri), held_out=FEW, served=ServedArgs(measure=False)
    )

    assert report.passed and report.scheme == "W4A16"  # the base came from the manifest
    assert str(tmp_path / "worker-cache" / "store-models") in report.compressed_path
    assert math.isfinite(report.metrics.compressed_perplexity) and report.metrics.kl_divergence > 0
    assert store.list() == before  # read, never written: results stay in Prefect and ClearML
