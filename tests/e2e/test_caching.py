"""Cached stage results survive only as long as the code and libraries that produced them."""

from __future__ import annotations

import pickle
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect import task

from compressflow.store import caching, identity

pytestmark = pytest.mark.usefixtures("prefect_harness")


@task(cache_policy=caching.LocalSourceAware(), persist_result=True)
def echo(value: str) -> str:
    return value


def test_results_pickled_by_older_result_models_are_not_reused(monkeypatch):
    value = uuid.uuid4().hex  # a key no earlier test or session made
    assert echo(value, return_state=True).name != "Cached"
    assert echo(value, return_state=True).name == "Cached"
    # What upgrading compressflow does when compressflow/results.py changed (a field added).
    monkeypatch.setattr(identity, "code_identity", lambda: "another version of compressflow")
    assert echo(value, return_state=True).name != "Cached"


def test_an_unset_text_field_is_not_the_working_directory():
    from compressflow.params import ModelArgs
    from compressflow.store.identity import local_paths

    paths = local_paths({"args": ModelArgs(model_id="/models/x")})
    assert Path("/models/x") in paths
    assert Path("") not in paths and Path(".") not in paths


def key_of(policy: caching.CachePolicy) -> str:
    """The key for one fixed task source and input, computed afresh (no per-process memo)."""
    identity.code_identity.cache_clear()
    task_ctx = SimpleNamespace(task=SimpleNamespace(source_code="def render_recipe(args): ..."))
    return policy.compute_key(task_ctx, {"args": "W4A16"}, {})


@pytest.fixture()
def code_copy(tmp_path, monkeypatch) -> Path:
    """The key's source read from a copy of the recipe engine, which a test may then edit."""
    copy = tmp_path / "recipes"
    shutil.copytree(Path(caching.__file__).parent.parent / "recipes", copy)
    monkeypatch.setattr(identity, "package_folders", lambda: [copy])
    yield copy
    identity.code_identity.cache_clear()  # later tests see the real package again


def test_the_key_changes_with_the_source_of_code_the_task_calls(code_copy):
    policy = caching.LocalSourceAware()
    before = key_of(policy)
    assert key_of(policy) == before  # same code, same libraries: same key
    assert key_of(pickle.loads(pickle.dumps(policy))) == before  # Prefect pickles the policy
    helper = code_copy / "placeholders.py"
    helper.write_text(helper.read_text() + "\n# a fix to substitution\n")
    assert key_of(policy) != before


def test_the_key_changes_with_a_library_upgrade(code_copy, monkeypatch):
    import importlib.metadata

    policy = caching.LocalSourceAware()
    before = key_of(policy)
    installed = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "99.0" if name == "compressed-tensors" else installed(name),
    )
    assert key_of(policy) != before


def test_the_package_hash_covers_every_part_of_the_installed_package():
    import importlib.util

    folders = identity.package_folders()
    for name in ("compressflow", "compressflow.flows", "compressflow.tasks", "compressflow.blocks"):
        module = Path(importlib.util.find_spec(name).origin).resolve()
        assert any(module.is_relative_to(folder) for folder in folders), name
