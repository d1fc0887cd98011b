"""Upload: commits the published folder to `output.upload_uri`, the artifact upload stage.

After verify and publish (the folder is sealed), its files go to the store as a commit
(`compressflow.store.objects.commit_folder`): each object checked after upload, the manifest
last, so a reader of the prefix never sees half a model; a prefix that already holds this output
intact sends nothing, one holding part of it (a cut upload) gets only what is missing or wrong.
Credentials come from the AwsCredentials block `output.upload_credentials` names, else the
worker's AWS_* environment; they are never logged, nor written into the manifest, the card,
ClearML or an artifact.

`upload` follows a new publish: once the model is in the store, the ClearML OutputModel is
registered at its URI (no second copy of the weights sent) and the run's summary names it.
`upload_reused` follows a reuse of the local folder: it makes sure the upload is complete (a
run cut while uploading is resumed); the flow shows the reuse's summary itself.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.logs import run_logger
from compressflow.params import OutputArgs
from compressflow.reporting import tracking
from compressflow.reporting.summary import create_summary, register_published
from compressflow.results import PublishedModel, StageRecord
from compressflow.store.manifest import read_manifest
from compressflow.store.objects import commit_folder


def _commit(published: PublishedModel, output: OutputArgs) -> PublishedModel:
    folder = Path(published.path)
    done = commit_folder(
        folder,
        output.upload_uri,
        overwrite=output.overwrite,
        credentials_block=output.upload_credentials,
    )
    if done.reused:
        run_logger(__name__).info("%s already holds %s, intact: nothing sent", done.uri, folder)
    else:
        run_logger(__name__).info(
            "Uploaded %s to %s: %d files sent (%.1f MB), %d already there, %d replaced",
            folder,
            done.uri,
            len(done.sent),
            done.bytes_sent / 1e6,
            len(done.kept),
            len(done.deleted),
        )
    # What the store got, for ClearML: names and counts, never a credential.
    tracking.current().artifact(
        "upload",
        {
            "uri": done.uri,
            "reused": done.reused,
            "sent": done.sent,
            "kept": done.kept,
            "deleted": done.deleted,
            "bytes_sent": done.bytes_sent,
        },
    )
    return published.model_copy(update={"upload_uri": output.upload_uri})


@task(name="upload", cache_policy=NO_CACHE)
def upload(
    published: PublishedModel, output: OutputArgs, stages: list[StageRecord]
) -> PublishedModel:
    """Commit the newly published folder to `output.upload_uri`, then register it in ClearML
    at that URI and write the run's summary, whose stage table ends with this stage
    (`stages`: the run's stages before it)."""
    started = time.perf_counter()
    uploaded = _commit(published, output)
    manifest = read_manifest(Path(published.path))
    register_published(uploaded, manifest, output.tags)
    uploading = StageRecord(
        name="upload", seconds=round(time.perf_counter() - started, 3), cached=False
    )
    create_summary(uploaded, manifest, [*stages, uploading])
    return uploaded


@task(name="upload", cache_policy=NO_CACHE)
def upload_reused(published: PublishedModel, output: OutputArgs) -> PublishedModel:
    """Make sure the reused local output is at `output.upload_uri`, complete: nothing is sent
    when it is there intact; a cut or corrupted upload gets what is missing or wrong."""
    return _commit(published, output)
