"""A model read from object storage (compressflow.store.sources, the fetch stage's `store`
source): an s3:// prefix on a real moto server process, or a file:// folder, downloaded once into
the worker's cache, verified against the manifest compressflow uploaded with it, refused early
when the URI, the bucket, the credentials or the objects are wrong."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from support.s3_server import s3_server  # noqa: F401  (the fixture)

from compressflow.errors import InputError, ModelFetchError
from compressflow.model.folder_checks.files import local_folder
from compressflow.params import ModelArgs
from compressflow.store.identity import content_hash
from compressflow.store.object_clients import FileStore
from compressflow.store.object_s3 import S3Store
from compressflow.store.objects import commit_folder
from compressflow.store.sources import check_source, fetch_store
from compressflow.tasks.fetch_model import fetch, resolve_compressed

MANIFEST = "manifest.json"


def sealed(folder: Path, files: dict[str, bytes]) -> Path:
    """`files` as publish seals them: a manifest listing each and recording its sha256."""
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    manifest = {
        "created_at": "2026-12-07T00:00:00+00:00",
        "result": {"run_key": "k" * 64},
        "files": sorted([*files, MANIFEST]),
        "file_sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b"{}",
    "model.safetensors": os.urandom(1 << 16),
    "sub/extra.txt": b"nested",
}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def bucket(s3_server, request):  # noqa: F811
    name = "cf-src-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    s3_server.client().create_bucket(Bucket=name)
    return name


def downloads(monkeypatch) -> list[str]:
    """The names each store downloads from now on."""
    seen: list[str] = []
    for kind in (S3Store, FileStore):
        original = kind.download

        def counted(self, name, dest, original=original):
            seen.append(name)
            return original(self, name, dest)

        monkeypatch.setattr(kind, "download", counted)
    return seen


# --- a published prefix ------------------------------------------------------------------------


def test_a_published_s3_prefix_downloads_verified_once_then_from_the_cache(
    bucket, tmp_path, monkeypatch
):
    folder = sealed(tmp_path / "out", FILES)
    uri = f"s3://{bucket}/models/tiny"
    commit_folder(folder, uri)
    got = downloads(monkeypatch)
    first = fetch_store(uri)
    assert first.published and not first.reused and first.uri == uri
    assert sorted(got) == sorted(FILES)
    for name, data in FILES.items():
        assert (first.path / name).read_bytes() == data
    assert json.loads((first.path / MANIFEST).read_text())["file_sha256"]
    got.clear()
    again = fetch_store(uri)  # nothing changed: not a byte read
    assert again.reused and again.path == first.path and got == []


def test_a_killed_downloads_partial_copy_is_removed_by_the_next_fetch(tmp_path, cache):
    folder = sealed(tmp_path / "out", FILES)
    uri = f"file://{tmp_path}/store/tiny"
    commit_folder(folder, uri)
    first = fetch_store(uri)
    shutil.rmtree(first.path)  # as if the download had never finished: only its partial copy
    partial = first.path.parent / f".{first.path.name}.download-4242-deadbeef"
    (partial / "sub").mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half")
    again = fetch_store(uri)
    assert not again.reused and not partial.exists()
    assert (again.path / "config.json").read_bytes() == FILES["config.json"]


def test_a_prefix_written_since_downloads_again(bucket, tmp_path, s3_server):  # noqa: F811
    uri = f"s3://{bucket}/plain"
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="plain/config.json", Body=b"{}")
    first = fetch_store(uri)
    client.put_object(Bucket=bucket, Key="plain/config.json", Body=b'{"a": 1}')
    second = fetch_store(uri)
    assert second.path != first.path and not second.reused
    assert (second.path / "config.json").read_bytes() == b'{"a": 1}'


def test_a_corrupted_object_is_refused_before_anything_downloads(
    bucket,
    tmp_path,
    s3_server,  # noqa: F811
    monkeypatch,
    cache,
):
    folder = sealed(tmp_path / "out", FILES)
    uri = f"s3://{bucket}/models/corrupt"
    commit_folder(folder, uri)
    s3_server.client().put_object(
        Bucket=bucket, Key="models/corrupt/model.safetensors", Body=b"not the weights"
    )
    got = downloads(monkeypatch)
    with pytest.raises(ModelFetchError) as refused:
        fetch_store(uri)
    assert refused.value.field == "model.model_id"
    assert "model.safetensors" in refused.value.problem and "disagree" in refused.value.problem
    assert got == [] and not any((cache / "store-models").glob("[!.]*"))


def test_a_file_changed_in_a_published_folder_is_refused(tmp_path):
    folder = sealed(tmp_path / "out", FILES)
    target = tmp_path / "store" / "m"
    commit_folder(folder, f"file://{target}")
    (target / "config.json").write_text('{"model_type": "other"}')
    with pytest.raises(ModelFetchError, match="disagree with its manifest"):
        check_source(f"file://{target}")


# --- a foreign prefix --------------------------------------------------------------------------


def test_a_foreign_prefix_is_fetched_as_it_is_then_checked_as_a_folder(tiny_model, tmp_path):
    copy = tmp_path / "store" / "tiny"
    shutil.copytree(tiny_model, copy)
    fetched = fetch(ModelArgs(model_id=f"file://{copy}"))
    assert fetched.source == "store" and fetched.model_id == f"file://{copy}"
    assert fetched.identity == f"sha256:{content_hash(tiny_model)}"  # as a local folder's
    assert Path(fetched.path) != copy and fetched.parameters
    # The folder checks ran on the download: a config cut off is refused as a local one is.
    broken = tmp_path / "store" / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text('{"model_type": ')
    with pytest.raises(ModelFetchError, match="config.json"):
        fetch(ModelArgs(model_id=f"file://{broken}"))


def test_validation_downloads_the_configs_alone(tiny_model, tmp_path, monkeypatch):
    copy = tmp_path / "store" / "tiny"
    shutil.copytree(tiny_model, copy)
    got = downloads(monkeypatch)
    fetched = fetch(ModelArgs(model_id=f"file://{copy}"), weights=False)
    assert fetched.source == "store" and "config.json" in got
    assert not any(name.endswith(".safetensors") for name in got)


def test_evaluate_reads_only_a_prefix_compressflow_published(tmp_path):
    plain = tmp_path / "store" / "plain"
    plain.mkdir(parents=True)
    (plain / "config.json").write_text("{}")
    with pytest.raises(ModelFetchError) as refused:
        resolve_compressed(ModelArgs(model_id=f"file://{plain}"))
    assert refused.value.field == "compressed.model_id"
    assert "not a published compressflow model" in refused.value.problem


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri, words",
    [
        ("gs://bucket/model", "gs:// scheme"),
        ("s3://Not_A_Bucket/model", "not a valid bucket name"),
        ("s3://bucket", "names no prefix"),
        ("file://relative/model", "names the host"),
        ("s3://user:secret@bucket/model", "holds credentials"),
    ],
)
def test_a_bad_uri_is_refused_naming_the_field(uri, words):
    with pytest.raises(InputError) as refused:
        fetch(ModelArgs(model_id=uri))
    assert refused.value.field == "model.model_id" and words in refused.value.problem
    assert "secret" not in str(refused.value)


def test_a_store_uri_is_no_local_folder():
    assert local_folder(ModelArgs(model_id="s3://bucket/model")) is None


def test_a_missing_bucket_is_refused_naming_the_uri(s3_server):  # noqa: F811
    with pytest.raises(ModelFetchError) as refused:
        check_source("s3://no-such-bucket-here/model")
    assert refused.value.field == "model.model_id"
    assert "does not exist" in refused.value.problem


def test_wrong_credentials_are_refused_naming_the_credentials(bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with pytest.raises(ModelFetchError) as refused:
        check_source(f"s3://{bucket}/model")
    assert refused.value.field == "model.storage_credentials"
    assert "refused the credentials" in refused.value.problem
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in str(refused.value)


def test_an_empty_prefix_is_refused(bucket, tmp_path):
    for uri in (f"s3://{bucket}/nothing/here", f"file://{tmp_path}/nothing"):
        with pytest.raises(ModelFetchError, match="holds no objects"):
            check_source(uri)


def test_a_key_pasted_as_the_credentials_block_is_refused_unshown():
    key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    with pytest.raises(ValueError) as refused:  # pydantic's, around our InputError
        ModelArgs(model_id="s3://bucket/model", storage_credentials=key)
    assert "model.storage_credentials" in str(refused.value) and key not in str(refused.value)


def test_a_cache_too_small_for_the_download_is_refused_before_it(tmp_path, monkeypatch):
    from collections import namedtuple

    from compressflow.store import sources

    plain = tmp_path / "store" / "m"
    plain.mkdir(parents=True)
    (plain / "model.safetensors").write_bytes(b"x" * 4096)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sources.shutil, "disk_usage", lambda _: usage(1, 1, 100))
    got = downloads(monkeypatch)
    with pytest.raises(Exception, match="COMPRESSFLOW_CACHE_DIR"):
        fetch_store(f"file://{plain}")
    assert got == []
