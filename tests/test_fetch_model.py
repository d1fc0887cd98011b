"""Fetch model: local folders, the hub code path over a local cache, and early refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import HUB_SHA as SHA

from compressflow.errors import ModelFetchError
from compressflow.params import ModelArgs
from compressflow.store.caching import stat_signature
from compressflow.tasks.fetch_model import fetch


def copy_model(tiny_model: Path, tmp_path: Path, **config_changes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_local_folder_gets_a_content_identity(tiny_model):
    fetched = fetch(ModelArgs(model_id=str(tiny_model)))
    assert fetched.source == "local"
    assert fetched.identity.startswith("sha256:") and len(fetched.identity) == 7 + 64
    assert fetched.size_bytes > 1_000_000
    assert fetched.exists()
    assert fetch(ModelArgs(model_id=str(tiny_model))).identity == fetched.identity


def test_the_identity_hashes_files_in_name_order_whatever_thread_hashed_them(tmp_path):
    # Hashed on threads since; the identity must stay the one earlier runs recorded and cached.
    import hashlib

    from compressflow.tasks.fetch_model import content_hash

    for name in ["b.safetensors", "a/z.json", "a/b.txt", "c"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode() * 1000)
    digest = hashlib.sha256()
    for name in ["a/b.txt", "a/z.json", "b.safetensors", "c"]:
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((tmp_path / name).read_bytes()).digest())
    assert content_hash(tmp_path) == digest.hexdigest()


def test_editing_a_local_folder_changes_identity_and_cache_signature(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path)
    before = (fetch(ModelArgs(model_id=str(folder))).identity, stat_signature(folder))
    (folder / "generation_config.json").write_text("{}")
    after = (fetch(ModelArgs(model_id=str(folder))).identity, stat_signature(folder))
    assert before[0] != after[0] and before[1] != after[1]


def test_hub_id_resolves_to_the_cached_commit_sha(hub_cache):
    fetched = fetch(ModelArgs(model_id="acme/tiny-llama"))
    assert fetched.source == "hub"
    assert fetched.revision_resolved == SHA
    assert fetched.identity == f"hub:acme/tiny-llama@{SHA}"
    assert Path(fetched.path) == hub_cache / "snapshots" / SHA


def test_hub_commit_sha_revision_is_honoured(hub_cache):
    fetched = fetch(ModelArgs(model_id="acme/tiny-llama", revision=SHA))
    assert fetched.revision_requested == SHA and fetched.revision_resolved == SHA


def test_uncached_hub_revision_says_the_cache_lacks_it(hub_cache):
    with pytest.raises(ModelFetchError, match="not in the local hub cache") as error:
        fetch(ModelArgs(model_id="acme/tiny-llama", revision="v2"))
    assert "acme/tiny-llama@v2" in str(error.value)


def test_uncached_hub_model_says_the_cache_lacks_it():
    with pytest.raises(ModelFetchError, match="not in the local hub cache"):
        fetch(ModelArgs(model_id="acme/never-downloaded"))


def test_missing_local_folder_is_named():
    with pytest.raises(ModelFetchError, match=r"local folder \./no/such/model does not exist"):
        fetch(ModelArgs(model_id="./no/such/model"))


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelFetchError, match="no config.json"):
        fetch(ModelArgs(model_id=str(tmp_path)))


def test_remote_code_model_needs_trust_remote_code(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path, auto_map={"AutoModelForCausalLM": "modeling.Custom"})
    with pytest.raises(ModelFetchError, match="trust_remote_code: true"):
        fetch(ModelArgs(model_id=str(folder)))
    assert fetch(ModelArgs(model_id=str(folder), trust_remote_code=True)).trust_remote_code


def test_already_quantized_model_is_refused(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path, quantization_config={"quant_method": "gptq"})
    with pytest.raises(ModelFetchError, match=r"already quantized \(gptq\).*unquantized base"):
        fetch(ModelArgs(model_id=str(folder)))
