"""Publishing to object storage (compressflow.store.objects): a sealed folder committed to an
s3:// prefix (a real moto server process on loopback) or a file:// folder, manifest last,
checked, resumed, reused, owned and leased as a local output folder is."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from support.s3_server import s3_server  # noqa: F401  (the fixture)

from compressflow.errors import InputError, PublishError
from compressflow.store import object_lease
from compressflow.store.object_s3 import PART_BYTES, part_bytes, same_checksum
from compressflow.store.object_uri import parse_upload_uri
from compressflow.store.objects import (
    check_published,
    commit_folder,
    download_folder,
    open_store,
    probe,
    read_published,
)

CARD, MANIFEST = "README.md", "manifest.json"


def published_folder(folder: Path, run_key: str = "k" * 64, weights: int = 1 << 16) -> Path:
    """A sealed output as publish leaves it: files, a card, and a manifest naming each file and
    recording the sha256 of each but itself and the card (compressflow.store.manifest)."""
    files = {
        "model.safetensors": os.urandom(weights),
        "config.json": b'{"model_type": "llama"}',
        "recipe.yaml": run_key.encode(),
        "sub/tokenizer.json": b"{}",
        CARD: b"# card",
    }
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    digests = {n: hashlib.sha256(d).hexdigest() for n, d in files.items() if n != CARD}
    manifest = {
        "created_at": "2026-12-07T00:00:00+00:00",
        "result": {"run_key": run_key, "scheme": "W4A16"},
        "files": sorted([*files, MANIFEST]),
        "file_sha256": digests,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


@pytest.fixture
def bucket(s3_server, request):  # noqa: F811
    name = "cf-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:20]
    s3_server.client().create_bucket(Bucket=name)
    return name


def sends(store) -> Counter:
    """Counts the writes to each object of the prefix, by its name (the lease's included)."""
    counted = Counter()

    def count(params, **_):
        counted.update([params["Key"].split("/", 1)[1]])

    for call in ("PutObject", "UploadPart", "DeleteObject"):
        store.client.meta.events.register(f"before-parameter-build.s3.{call}", count)
    return counted


# --- URIs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri, words",
    [
        ("", "empty"),
        ("gs://bucket/prefix", "does not upload to yet"),
        ("ftp2://bucket/prefix", "not known"),
        ("/models/x", "no scheme"),
        ("s3://ab/prefix", "not a valid bucket"),
        ("s3://Bucket/prefix", "not a valid bucket"),
        ("s3://192.168.1.1/prefix", "not a valid bucket"),
        ("s3://bucket", "names no prefix"),
        ("s3://bucket/", "names no prefix"),
        ("s3://bucket/a/../b", ". or .. segment"),
        ("s3://bucket/a//b", "empty segment"),
        ("s3://bucket/a?versionId=1", "query"),
        ("s3://bucket/a#frag", "query"),
        ("s3://localhost:9000/a", "host and port"),
        ("s3://bucket/a b", "space"),
        ("file://host/x", "names the host"),
        ("file:///", "names no prefix"),
        ("file:///a/./b", ". or .. segment"),
    ],
)
def test_bad_uris_are_refused(uri, words):
    with pytest.raises(InputError) as refused:
        parse_upload_uri(uri)
    assert refused.value.field == "output.upload_uri"
    assert words in refused.value.problem
    assert refused.value.fix


def test_credentials_in_a_uri_are_never_echoed():
    with pytest.raises(InputError) as refused:
        parse_upload_uri("s3://AKIAX:hunter2@bucket/prefix")
    assert "hunter2" not in str(refused.value) and "AKIAX" not in str(refused.value)


def test_good_uris_parse():
    s3 = parse_upload_uri("s3://my-bucket/models/llama/")
    assert (s3.bucket, s3.prefix, s3.uri) == (
        "my-bucket",
        "models/llama",
        "s3://my-bucket/models/llama",
    )
    local = parse_upload_uri("file:///srv/models/my%20model")
    assert (local.scheme, local.prefix) == ("file", "/srv/models/my model")


def test_checksums_and_part_sizes():
    assert same_checksum("abc=-3", "abc=-3") and same_checksum("abc=", "abc=-3")
    assert not same_checksum("abc=-2", "abc=-3") and not same_checksum("abd=", "abc=-3")
    assert part_bytes(1 << 30) == PART_BYTES
    assert part_bytes(200 << 30) * 9_000 >= 200 << 30 and part_bytes(200 << 30) % (1 << 20) == 0


# --- file:// ----------------------------------------------------------------------------------


def test_file_store_upload_reuse_corruption_and_download(tmp_path):
    folder = published_folder(tmp_path / "out")
    target = tmp_path / "store" / "model"
    uri = f"file://{target}"
    first = commit_folder(folder, uri)
    assert not first.reused and MANIFEST not in first.sent and len(first.sent) == 5
    # The folder is laid out as a published output: nothing of ours inside it.
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()) == (
        sorted(json.loads((folder / MANIFEST).read_text())["files"])
    )
    assert not list(target.parent.glob(".model.upload-*"))
    again = commit_folder(folder, uri)
    assert again.reused and again.sent == []
    assert read_published(uri)["result"]["run_key"] == "k" * 64

    (target / "config.json").write_bytes(b'{"model_type": "other"}')
    manifest, why = check_published(uri)
    assert manifest is None and "config.json: other bytes" in why
    repaired = commit_folder(folder, uri)
    assert repaired.sent == ["config.json"] and read_published(uri) is not None

    dest = tmp_path / "copy"
    assert download_folder(uri, dest)["file_sha256"]["model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_file_store_probe(tmp_path):
    probe(f"file://{tmp_path}/a/b")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="which is a file"):
        probe(f"file://{tmp_path}/file/b")


# --- s3:// ------------------------------------------------------------------------------------


def test_upload_then_reuse_sends_nothing(tmp_path, bucket):
    # The weights pass PART_BYTES: a multipart upload, checked by its composite checksum.
    folder = published_folder(tmp_path / "out", weights=PART_BYTES + (1 << 20))
    uri = f"s3://{bucket}/models/llama-w4a16"
    store = open_store(uri)
    first = commit_folder(folder, store)
    assert len(first.sent) == 5 and first.bytes_sent > PART_BYTES
    listed = store.list()
    assert "-2" in listed["model.safetensors"].etag  # two parts
    assert not [n for n in listed if n.startswith(".compressflow-")]  # the lease is gone

    counted = sends(store)
    again = commit_folder(folder, store)
    assert again.reused and again.sent == [] and sum(counted.values()) == 0
    assert (
        read_published(uri)["file_sha256"]
        == json.loads((folder / MANIFEST).read_text())["file_sha256"]
    )


def test_a_cut_upload_is_completed_sending_only_what_is_missing(tmp_path, bucket, monkeypatch):
    folder = published_folder(tmp_path / "out")
    uri = f"s3://{bucket}/cut"
    store = open_store(uri)
    upload, uploaded = store.upload, []

    def killed_midway(name, path, sha256):
        if len(uploaded) == 2:
            raise KeyboardInterrupt  # the run dies on its third file
        uploaded.append(name)
        return upload(name, path, sha256)

    monkeypatch.setattr(store, "upload", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        commit_folder(folder, store)
    assert read_published(uri) is None  # two objects and no manifest: no output
    monkeypatch.undo()

    rerun = open_store(uri)
    counted = sends(rerun)
    done = commit_folder(folder, rerun)
    assert sorted(done.kept) == sorted(uploaded) and len(done.sent) == 3
    files = {n for n in counted if not n.startswith(".compressflow-")}
    assert files == {*done.sent, MANIFEST}
    assert read_published(uri) is not None


def test_an_uploader_killed_midway_is_completed_by_a_rerun_once_its_lease_is_stale(
    tmp_path,
    bucket,
    s3_server,  # noqa: F811
):
    """A real kill (SIGKILL: no `finally`, the lease left live) in the middle of a multipart
    upload; the rerun waits for the lease to go stale, takes it over with what it owned, and
    sends only what is missing."""
    import signal
    import subprocess
    import sys

    folder = published_folder(tmp_path / "out", weights=96 << 20)  # 12 parts of 8 MiB
    uri = f"s3://{bucket}/killed"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; "
            "from compressflow.store.objects import commit_folder; "
            "commit_folder(Path(sys.argv[1]), sys.argv[2], lease_seconds=3)",
            str(folder),
            uri,
        ]
    )
    client, deadline = s3_server.client(), time.monotonic() + 120
    try:  # config.json lands before model.safetensors (sorted): then the weights are on their way
        while time.monotonic() < deadline and child.poll() is None:
            keys = client.list_objects_v2(Bucket=bucket, Prefix="killed/").get("Contents", [])
            if any(item["Key"] == "killed/config.json" for item in keys):
                break
            time.sleep(0.05)
        assert child.poll() is None, "the upload ended before it could be killed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert read_published(uri) is None  # a lease, some objects, no manifest: no output

    done = commit_folder(folder, uri, wait_seconds=60)
    assert not done.reused and "config.json" in done.kept and "model.safetensors" in done.sent
    manifest = read_published(uri)
    assert manifest is not None and manifest["result"]["run_key"] == "k" * 64


def test_a_corrupted_object_is_not_reused_and_is_sent_again(tmp_path, bucket, s3_server):  # noqa: F811
    folder = published_folder(tmp_path / "out")
    uri = f"s3://{bucket}/corrupt"
    commit_folder(folder, uri)
    s3_server.client().put_object(Bucket=bucket, Key="corrupt/config.json", Body=b"{}")
    manifest, why = check_published(uri)
    assert manifest is None and "config.json: other bytes" in why
    with pytest.raises(PublishError, match="disagree with its manifest"):
        download_folder(uri, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    again = commit_folder(folder, uri)
    assert not again.reused and again.sent == ["config.json"]
    assert read_published(uri) is not None


def test_a_file_changed_after_sealing_is_never_published(tmp_path, bucket):
    folder = published_folder(tmp_path / "out")
    (folder / "config.json").write_bytes(b"changed")
    uri = f"s3://{bucket}/changed"
    with pytest.raises(PublishError, match="changed after the output was sealed"):
        commit_folder(folder, uri)
    assert read_published(uri) is None


def test_probe_refuses_wrong_credentials_and_a_missing_bucket(bucket, s3_server, monkeypatch):  # noqa: F811
    probe(f"s3://{bucket}/ok")  # writes and deletes its probe object
    assert open_store(f"s3://{bucket}/ok").list() == {}
    with pytest.raises(InputError) as missing:
        probe("s3://no-such-bucket-here/x")
    assert missing.value.field == "output.upload_uri" and "create the bucket" in missing.value.fix
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY0000")
    with pytest.raises(InputError) as wrong:
        probe(f"s3://{bucket}/ok")
    assert wrong.value.field == "output.upload_uri" and "AWS_ACCESS_KEY_ID" in wrong.value.fix
    assert "not-the-secret" not in str(wrong.value)


def test_a_prefix_holding_other_objects_is_refused(tmp_path, bucket, s3_server):  # noqa: F811
    s3_server.client().put_object(Bucket=bucket, Key="theirs/notes.txt", Body=b"mine")
    with pytest.raises(InputError, match=r"1 objects compressflow did not publish there \(notes"):
        commit_folder(published_folder(tmp_path / "out"), f"s3://{bucket}/theirs", overwrite=True)


def test_a_prefix_holding_other_objects_is_refused_by_the_probe_before_calibrating(
    tmp_path,
    bucket,
    s3_server,  # noqa: F811
):
    uri = f"s3://{bucket}/early"
    probe(uri)  # empty: writable, nothing foreign
    commit_folder(published_folder(tmp_path / "out"), uri)
    probe(uri)  # our own output: not foreign
    s3_server.client().put_object(Bucket=bucket, Key="early/notes.txt", Body=b"mine")
    with pytest.raises(InputError, match=r"1 objects compressflow did not publish there \(notes"):
        probe(uri)


def test_overwrite_replaces_only_what_the_manifest_lists(tmp_path, bucket):
    uri = f"s3://{bucket}/replace"
    old = published_folder(tmp_path / "old", run_key="a" * 64)
    (old / "extra.bin").write_bytes(b"old only")
    manifest = json.loads((old / MANIFEST).read_text())
    manifest["files"].append("extra.bin")
    manifest["file_sha256"]["extra.bin"] = hashlib.sha256(b"old only").hexdigest()
    (old / MANIFEST).write_text(json.dumps(manifest))
    commit_folder(old, uri)
    new = published_folder(tmp_path / "new", run_key="b" * 64)
    with pytest.raises(PublishError, match="already holds another compressflow output"):
        commit_folder(new, uri)
    done = commit_folder(new, uri, overwrite=True)
    assert done.deleted == ["extra.bin"] and "extra.bin" not in open_store(uri).list()
    assert read_published(uri)["result"]["run_key"] == "b" * 64


def test_a_second_run_waits_for_the_lease_then_reuses_or_is_refused(tmp_path, bucket):
    folder = published_folder(tmp_path / "out")
    uri = f"s3://{bucket}/leased"
    first_store = open_store(uri)
    upload = first_store.upload

    def slow(name, path, sha256):
        time.sleep(0.5)
        return upload(name, path, sha256)

    first_store.upload = slow
    first = threading.Thread(target=commit_folder, args=(folder, first_store))
    first.start()
    deadline = time.monotonic() + 10
    while object_lease.LEASE not in open_store(uri).list() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(PublishError, match="still being uploaded to by pid"):
        commit_folder(folder, uri, wait_seconds=0.3)
    second = commit_folder(folder, uri, wait_seconds=30)
    first.join()
    assert second.reused and second.sent == []


def test_a_stale_lease_is_taken_over_with_what_it_owned(tmp_path, bucket, s3_server):  # noqa: F811
    folder = published_folder(tmp_path / "out")
    client = s3_server.client()
    stale = {"run_key": "x", "host": "gone", "pid": 1, "ttl_seconds": 0.1, "owned": ["old.bin"]}
    client.put_object(Bucket=bucket, Key="stale/.compressflow-lease.json", Body=json.dumps(stale))
    client.put_object(Bucket=bucket, Key="stale/old.bin", Body=b"left by a killed run")
    time.sleep(1.1)  # S3's clock has a one-second grain
    done = commit_folder(folder, f"s3://{bucket}/stale", wait_seconds=0)
    assert done.deleted == ["old.bin"] and read_published(f"s3://{bucket}/stale") is not None


def test_download_round_trip_and_a_source_that_is_not_ours(tmp_path, bucket, s3_server):  # noqa: F811
    folder = published_folder(tmp_path / "out")
    uri = f"s3://{bucket}/round"
    commit_folder(folder, uri)
    dest = tmp_path / "fetched"
    manifest = download_folder(uri, dest)
    assert manifest["result"]["run_key"] == "k" * 64 and "objects" not in manifest
    for name in manifest["files"]:
        if name != MANIFEST:
            assert (dest / name).read_bytes() == (folder / name).read_bytes()

    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="hub/org/model/config.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key="hub/org/model/model.safetensors", Body=b"w")
    assert download_folder(f"s3://{bucket}/hub/org/model", tmp_path / "hub") is None
    assert (tmp_path / "hub" / "model.safetensors").read_bytes() == b"w"


def test_the_upload_record_is_the_proof(tmp_path):
    """A manifest without the record of each object as uploaded (e.g. copied in by hand) is not
    taken for a published output."""
    store_root = tmp_path / "store"
    folder = published_folder(store_root)  # the folder itself, never uploaded through a commit
    manifest, why = check_published(f"file://{folder}")
    assert manifest is None and "not one compressflow uploaded" in why


def test_credentials_from_an_aws_credentials_block(tmp_path, bucket, s3_server, monkeypatch):  # noqa: F811
    """The block gives the keys and the endpoint (none in the environment); a wrong secret in it
    is refused naming the block's field, and no secret is ever echoed."""
    from prefect_aws import AwsCredentials

    def block(secret: str) -> AwsCredentials:
        return AwsCredentials(
            aws_access_key_id=s3_server.key_id,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            aws_client_parameters={"endpoint_url": s3_server.endpoint},
        )

    blocks = {"store": block(s3_server.secret), "stale": block("not-the-secret")}

    def load(name, *args, **kwargs):
        if name not in blocks:
            raise ValueError(f"Unable to find block document named {name}")
        return blocks[name]

    monkeypatch.setattr(AwsCredentials, "load", load)
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    uri = f"s3://{bucket}/from-block"
    probe(uri, credentials_block="store")
    assert commit_folder(published_folder(tmp_path / "out"), uri, credentials_block="store").sent
    with pytest.raises(InputError) as wrong:
        probe(uri, credentials_block="stale")
    assert wrong.value.field == "output.upload_credentials" and "not-the-secret" not in str(
        wrong.value
    )
    with pytest.raises(InputError, match="no AwsCredentials block is named 'nope'") as missing:
        probe(uri, credentials_block="nope")
    assert missing.value.field == "output.upload_credentials"
