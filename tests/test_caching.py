"""Cached stage results survive only as long as the result models they were pickled from."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from prefect import task

from compressflow.store import caching

pytestmark = pytest.mark.usefixtures("prefect_harness")


@task(cache_policy=caching.LocalSourceAware(), persist_result=True)
def echo(value: str) -> str:
    return value


def test_results_pickled_by_older_result_models_are_not_reused(monkeypatch):
    value = uuid.uuid4().hex  # a key no earlier test or session made
    assert echo(value, return_state=True).name != "Cached"
    assert echo(value, return_state=True).name == "Cached"
    # What upgrading compressflow does when compressflow/results.py changed (a field added).
    monkeypatch.setattr(caching, "RESULTS_SOURCE", "results.py of another version")
    assert echo(value, return_state=True).name != "Cached"


def test_an_unset_text_field_is_not_the_working_directory():
    from compressflow.params import ModelArgs
    from compressflow.store.caching import local_paths

    paths = local_paths({"args": ModelArgs(model_id="/models/x")})
    assert Path("/models/x") in paths
    assert Path("") not in paths and Path(".") not in paths
