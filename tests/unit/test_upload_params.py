"""`output.upload_uri` and `output.upload_credentials` (issue 56): refused in the parameters'
own validation (the form, `validate`'s schema check), and by `validate`'s early checks against a
real S3 server (moto, tests/support/s3_server.py) before any weights load: a missing bucket,
credentials the store refuses, an upload that overlaps the model or the output. The upload
stage itself runs end to end in tests/e2e/test_upload.py."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError
from support.parameters import params
from support.s3_server import s3_server  # noqa: F401  (the fixture)

from compressflow.errors import InputError
from compressflow.flows.validate import validate
from compressflow.params import OutputArgs
from compressflow.reporting.model_card import serve_command
from compressflow.runtime.events import published_payload
from compressflow.store.output import check_upload_apart

FIELD = "output.upload_uri"


@pytest.mark.parametrize(
    "uri, words",
    [
        ("gs://bucket/prefix", "does not upload to yet"),
        ("ftpx://bucket/prefix", "not known"),
        ("s3://ab/prefix", "not a valid bucket name"),
        ("s3://bucket", "names no prefix"),
        ("s3://bucket/a/../b", ". or .. segment"),
        ("s3://bucket/prefix?versionId=3", "query or a fragment"),
        ("s3://127.0.0.1:9000/prefix", "host and port"),
        ("file://relative/path", "names the host"),
        ("/abs/path", "has no scheme"),
    ],
)
def test_a_malformed_upload_uri_is_refused_by_the_parameters(uri, words):
    with pytest.raises(ValidationError) as refused:
        OutputArgs(upload_uri=uri)
    assert FIELD in str(refused.value) and words in str(refused.value)


def test_credentials_in_the_uri_or_as_the_block_name_are_never_echoed():
    with pytest.raises(ValidationError) as refused:
        OutputArgs(upload_uri="s3://AKIAEXAMPLE:hunter2secret@bucket/prefix")
    assert FIELD in str(refused.value) and "hunter2secret" not in str(refused.value)
    with pytest.raises(ValidationError) as key:
        OutputArgs(upload_credentials="wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    text = str(key.value)
    assert "output.upload_credentials" in text and "wJalrXUtnFEMI" not in text


def test_an_upload_uri_is_kept_in_one_spelling_and_the_form_knows_the_schemes():
    assert OutputArgs(upload_uri="S3://my-bucket/models/llama/").upload_uri == (
        "s3://my-bucket/models/llama"
    )
    assert OutputArgs(upload_uri="file:///srv/models/x/").upload_uri == "file:///srv/models/x"
    # Found by the fuzzer: an escaped space came back unescaped, which the schema then refused.
    assert OutputArgs(upload_uri="file:///srv/my%20models/x").upload_uri == (
        "file:///srv/my%20models/x"
    )
    assert OutputArgs().upload_uri == "" and OutputArgs().upload_credentials == ""
    schema = OutputArgs.model_json_schema()["properties"]
    assert "s3|file" in schema["upload_uri"]["pattern"]
    for name in ("upload_uri", "upload_credentials"):
        assert "never" in schema[name]["description"], "the form says where credentials go"


def test_an_upload_into_the_model_or_the_output_is_refused(tmp_path):
    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    (tmp_path / "link").symlink_to(model)
    for uri, place in [
        (f"file://{model}", "is"),
        (f"file://{tmp_path}/link/sub", "lies inside"),
        (f"file://{tmp_path}", "contains"),
    ]:
        with pytest.raises(InputError, match=place) as refused:
            check_upload_apart(uri, [("the source model's folder", model)])
        assert refused.value.field == FIELD
    with pytest.raises(InputError, match="lies inside the output folder"):
        check_upload_apart(f"file://{out}/up", [("the output folder", out)])
    # A model read from the same store: the same prefix, or one inside the other.
    for uri in ("s3://models/llama", "s3://models/llama/w4a16", "s3://models"):
        with pytest.raises(InputError):
            check_upload_apart(uri, [("the source model", "s3://models/llama/")])
    check_upload_apart("s3://models/llama-w4a16", [("the source model", "s3://models/llama")])
    check_upload_apart("s3://other/llama", [("the source model", "s3://models/llama")])
    check_upload_apart(f"file://{tmp_path}/up", [("m", model), ("o", out)])


def test_the_card_serves_from_the_store_and_the_event_carries_the_uri(tmp_path):
    assert serve_command(tmp_path, "s3://b-1/m") == (
        "vllm serve s3://b-1/m --load-format runai_streamer"
    )
    assert serve_command(tmp_path, "file:///srv/m") == "vllm serve /srv/m"
    assert serve_command(tmp_path, "file:///srv/my%20m") == "vllm serve '/srv/my m'"
    assert serve_command("/out/m", "", kv_cache=True) == "vllm serve /out/m --kv-cache-dtype fp8"
    from compressflow.params import ModelArgs
    from compressflow.results import PublishedModel

    published = PublishedModel(
        path="/out/m",
        run_key="k",
        reused=False,
        model_identity="i",
        scheme="W4A16",
        size_bytes=1,
        original_size_bytes=2,
        compression_ratio=2.0,
        upload_uri="s3://b-1/m",
    )
    payload = published_payload(published, ModelArgs(model_id="x/y"), None)
    assert payload["upload_uri"] == "s3://b-1/m"


# --- validate, against a real S3 server ---------------------------------------------------


@pytest.fixture
def bucket(s3_server, request):  # noqa: F811
    name = "cf-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:20]
    s3_server.client().create_bucket(Bucket=name)
    return name


def test_validate_probes_the_store_before_any_weights(models, tmp_path, bucket, monkeypatch):
    report = validate(**params(models, tmp_path, output={"upload_uri": f"s3://{bucket}/m"}))
    assert not report.reuses_output
    with pytest.raises(InputError) as missing:
        validate(**params(models, tmp_path, output={"upload_uri": "s3://no-such-bucket-56/m"}))
    assert missing.value.field == FIELD and "bucket" in missing.value.problem
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY0000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(InputError) as wrong:
        validate(**params(models, tmp_path, output={"upload_uri": f"s3://{bucket}/m"}))
    assert wrong.value.field == FIELD and "not-the-secret" not in str(wrong.value)
    assert not (tmp_path / "out").exists()


def test_validate_refuses_an_upload_into_the_source_without_writing_there(models, tmp_path):
    from pathlib import Path

    source = Path(models["plain"])
    before = sorted(p.name for p in source.rglob("*"))
    with pytest.raises(InputError, match="the source model's folder") as refused:
        validate(**params(models, tmp_path, output={"upload_uri": f"file://{source}/up"}))
    assert refused.value.field == FIELD
    assert sorted(p.name for p in source.rglob("*")) == before
    with pytest.raises(InputError, match="the output folder"):
        validate(**params(models, tmp_path, output={"upload_uri": f"file://{tmp_path}/out"}))
    validate(**params(models, tmp_path, output={"upload_uri": f"file://{tmp_path}/store/m"}))
    assert not (tmp_path / "store").exists(), "the probe leaves nothing behind"
