"""The artifact upload stage end to end (issue 56), against a real S3 server (moto's server
process, tests/support/s3_server.py): a run publishes, then commits its folder to
`output.upload_uri`; every object in the store is what the manifest lists; a second run on a
"fresh worker" (an empty output folder of its own) reuses the upload without calibrating or
sending a byte. `make test` keeps this one round trip; the longer drills (a cut upload resumed,
a corrupted object) are tests/unit/test_object_store.py's, on the commit layer itself.

Data-free FP8_DYNAMIC on the session's tiny model: the cheapest run that goes through every
stage the upload follows (calibrate, verify, publish).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from support.s3_server import s3_server  # noqa: F401  (the fixture)

from compressflow.flows.compress import compress
from compressflow.params import ModelArgs, OutputArgs, RecipeArgs

pytestmark = pytest.mark.usefixtures("prefect_harness")


def stored(client, bucket: str, prefix: str) -> dict[str, tuple[str, str]]:
    """name -> (etag, last modified) of every object under the prefix."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {
        item["Key"][len(prefix) + 1 :]: (item["ETag"], str(item["LastModified"]))
        for page in pages
        for item in page.get("Contents", [])
    }


def test_upload_then_a_fresh_worker_reuses_it_from_the_store(tiny_model, tmp_path, s3_server):  # noqa: F811
    client, bucket, prefix = s3_server.client(), "cf-e2e-upload", "tiny/fp8"
    client.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/{prefix}"

    def run(folder: Path):
        return compress(
            model=ModelArgs(model_id=str(tiny_model)),
            recipe=RecipeArgs(recipe="FP8_DYNAMIC"),
            output=OutputArgs(save_directory=str(folder), upload_uri=uri, tags=["upload"]),
        )

    first = run(tmp_path / "worker-a" / "out")
    names = [stage.name for stage in first.stages]
    assert names.index("upload") == names.index("publish") + 1 and "calibrate" in names
    assert (first.upload_uri, first.reused, first.path) == (
        uri,
        False,
        str(tmp_path / "worker-a" / "out"),
    )

    # Every object is what the local manifest lists, byte for byte; the manifest came last
    # and records each object as uploaded.
    folder = Path(first.path)
    local = json.loads((folder / "manifest.json").read_text())
    objects = stored(client, bucket, prefix)
    assert set(objects) == set(local["files"]), "nothing missing, nothing extra (no lease left)"
    for name in local["files"]:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()
        if name == "manifest.json":
            remote = json.loads(body)
            assert set(remote.pop("objects")) == set(local["files"]) - {"manifest.json"}
            assert remote == local
        else:
            assert body == (folder / name).read_bytes(), name
            if name in local["file_sha256"]:
                assert hashlib.sha256(body).hexdigest() == local["file_sha256"][name]
        # No credential reaches the store: the manifest records the block name (none) only.
        assert s3_server.secret.encode() not in body and s3_server.key_id.encode() not in body
    card = (folder / "README.md").read_text()
    assert f"vllm serve {uri} --load-format runai_streamer" in card
    assert local["inputs"]["output"]["upload_uri"] == uri

    # ClearML (offline) records the model at its URI: no second copy zipped into the session.
    mode, _, session = first.tracking.partition(": ")
    task = json.loads((Path(session.split(";")[0]) / "task.json").read_text())
    (model,) = [a for a in task["execution"]["artifacts"] if a["key"] == "compressed-model"]
    assert uri in json.dumps(model)

    # A fresh worker: an output folder of its own, empty. The store's upload is reused: no
    # calibration, no upload stage, not a byte written to the store, nothing downloaded.
    second = run(tmp_path / "worker-b" / "out")
    assert second.reused and (second.path, second.upload_uri) == (uri, uri)
    assert second.run_key == first.run_key
    names = [stage.name for stage in second.stages]
    assert "calibrate" not in names and "upload" not in names and "verify" not in names
    assert stored(client, bucket, prefix) == objects, "no object written again"
    assert not (tmp_path / "worker-b" / "out").exists()

    # The first worker's rerun: its local copy reused, the upload found complete, nothing sent.
    third = run(folder)
    assert third.reused and third.path == str(folder) and third.upload_uri == uri
    assert "upload" in [stage.name for stage in third.stages]
    assert stored(client, bucket, prefix) == objects
