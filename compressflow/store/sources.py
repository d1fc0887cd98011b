"""A model read from object storage: `model.model_id: s3://bucket/prefix` or `file:///abs/path`,
downloaded once into the worker's cache, then a local source like any folder.

- The URI is parsed as `output.upload_uri` is (`compressflow.store.object_uri`: the same two
  schemes, refused the same way), naming the field that gave it; s3:// credentials come from
  the AwsCredentials block `storage_credentials` names, else the worker's environment.
- One listing and one manifest read (`compressflow.store.objects.look`) decide everything cheap,
  before a byte of weights moves: a bucket that does not exist, credentials the store refuses,
  an empty prefix, a published prefix whose objects disagree with its manifest, a cache disk too
  small for the download. Each is an error naming the field and the fix.
- A prefix compressflow published is downloaded only intact, each file checked against the
  sha256 its manifest records (`download_folder`); a foreign prefix (a model other tools put
  there) is downloaded as it is, and then checked as any folder is (the fetch stage's folder
  checks). `published_only` (evaluate-model's compressed model) refuses a foreign prefix.
- The download lands in `<COMPRESSFLOW_CACHE_DIR>/store-models/<key>`, the key being the URI and
  each object's name, size and etag (`store_listing_key`): a prefix written since downloads
  again, an unchanged one is reused without a byte read. Concurrent fetches of one key wait on
  one lock (flock), and the folder appears whole or not at all (renamed into place).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from compressflow.errors import CompressflowError, ModelFetchError, SettingsError
from compressflow.logs import run_logger
from compressflow.model.args import is_store_uri
from compressflow.settings import cache_root, variable
from compressflow.store.identity import store_listing_key
from compressflow.store.locks import output_lock
from compressflow.store.manifest import MANIFEST
from compressflow.store.object_clients import RESERVED, FileStore, ObjectStore
from compressflow.store.object_uri import parse_upload_uri
from compressflow.store.objects import Look, download_folder, look

FIELD, BLOCK_FIELD = "model.model_id", "model.storage_credentials"
FOLDER = "store-models"  # under the cache folder: one subfolder per prefix and listing
# What validation reads of a store model (as of a hub one): configs and tokenizer, no weights.
CONFIG_PATTERNS = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py"]
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Downloaded:
    """A store model on this worker's disk: `path` (never written to), the URI it came from,
    whether a compressflow manifest vouched for every file, and whether it was already cached."""

    path: Path
    uri: str
    published: bool
    reused: bool


def open_source(uri: str, credentials_block: str = "", field: str = FIELD) -> ObjectStore:
    """The store of the prefix `uri` names (refused as `parse_upload_uri` refuses, naming
    `field`); s3:// with the AwsCredentials block `credentials_block`, else the environment."""
    location = parse_upload_uri(uri, field)
    if location.scheme == "file":
        return FileStore(location)
    from compressflow.store.object_s3 import open_s3

    return open_s3(location, credentials_block, _block_field(field))


def _block_field(field: str) -> str:
    return f"{field.split('.')[0]}.storage_credentials" if "." in field else BLOCK_FIELD


def look_source(store: ObjectStore, field: str = FIELD) -> Look:
    """One listing and one manifest read of the prefix; what the store refuses is an error
    naming `field` (or its storage_credentials) and the fix. An empty prefix is refused."""
    uri = store.location.uri
    if isinstance(store, FileStore) and store.root.exists() and not store.root.is_dir():
        raise ModelFetchError(field, f"{uri} is a file, not a folder", "name the model's folder")
    try:
        seen = look(store)
    except CompressflowError:
        raise
    except Exception as exc:  # botocore's, told apart by name: boto3 is imported only for s3://
        raise _refusal(store, field, exc) from None
    if not [name for name in seen.listing if not name.startswith(RESERVED)]:
        raise ModelFetchError(
            field,
            f"{uri} holds no objects",
            "check the URI (a prefix is the folder the model's files are in, with no trailing "
            "file name), or upload the model there first",
        )
    return seen


def _refusal(store: ObjectStore, field: str, exc: Exception) -> CompressflowError:
    """What reading the prefix failed on, in the store's words: bucket, credentials, access."""
    from compressflow.store.object_s3 import Place, refusal

    creds_field = _block_field(field)
    creds = (
        f"the AwsCredentials block named in {creds_field}"
        if getattr(store, "credentials_field", "")
        else "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the worker's environment, or name "
        f"an AwsCredentials block in {creds_field}"
    )
    location = store.location
    return refusal(
        exc,
        Place(field, creds_field, creds, location.uri, location.bucket, "read"),
        ModelFetchError,
        f"correct the bucket's name in {field} (or the endpoint, AWS_ENDPOINT_URL)",
        "s3:ListBucket and s3:GetObject",
    )


def check_source(
    uri: str, credentials_block: str = "", field: str = FIELD, published_only: bool = False
) -> Look:
    """The cheap refusals of a store model, before anything downloads (the flow's precheck and
    `validate` run them): the URI, the store's answer to a listing, an empty prefix, a published
    prefix that is not intact, and with `published_only` a prefix compressflow did not publish."""
    store = open_source(uri, credentials_block, field)
    return _checked(store, look_source(store, field), field, published_only)


def _checked(store: ObjectStore, seen: Look, field: str, published_only: bool) -> Look:
    uri = store.location.uri
    if seen.manifest_found and seen.departures:
        raise ModelFetchError(
            field,
            f"{uri} holds a compressflow output whose objects disagree with its manifest "
            f"({'; '.join(seen.departures[:3])}), so it is not read",
            "publish it again to that prefix (a rerun sends only what is missing or wrong), or "
            "name another prefix",
        )
    if published_only and not seen.manifest_found:
        raise ModelFetchError(
            field,
            f"{uri} is not a published compressflow model: it holds no {MANIFEST} recording the "
            "sha256 of its files, so what it holds cannot be checked",
            "name the prefix compress-model uploaded to (its output.upload_uri), or give the "
            "model as a local folder",
        )
    return seen


def listing_key(uri: str, credentials_block: str = "") -> str | None:
    """The fetch cache's view of a store model (`store_listing_key` of one listing), or None
    when `uri` is no store URI or the listing fails (the fetch then runs and says why)."""
    if not is_store_uri(uri):
        return None
    try:
        store = open_source(uri, credentials_block)
        listing = store.list()
    except Exception:  # the fetch itself refuses it, with the field and the fix
        return None
    return store_listing_key(store.location.uri, _sizes(listing))


def _sizes(listing: dict) -> dict[str, tuple[int, str]]:
    return {n: (o.size, o.etag) for n, o in listing.items() if not n.startswith(RESERVED)}


def fetch_store(
    uri: str,
    credentials_block: str = "",
    *,
    field: str = FIELD,
    weights: bool = True,
    published_only: bool = False,
) -> Downloaded:
    """The store model `uri` names, in this worker's cache (downloaded once per listing); see
    the module's docstring. `weights=False` (validation) downloads its configs only."""
    store = open_source(uri, credentials_block, field)
    seen = _checked(store, look_source(store, field), field, published_only)
    key = store_listing_key(store.location.uri, _sizes(seen.listing))
    dest = cache_root() / FOLDER / (key[:32] if weights else f"{key[:32]}-config")
    log = run_logger(__name__)
    # One download per cache entry across this host's processes; a waiter finds the folder.
    with output_lock(dest, log, field=field, error=ModelFetchError):
        if dest.is_dir():
            log.info("%s: reusing its download in %s", store.location.uri, dest)
            return Downloaded(dest, store.location.uri, seen.manifest is not None, True)
        # A download killed before its rename leaves its partial copy beside `dest` (in this
        # worker's cache, named by us): under the lock no other one is writing it.
        for partial in dest.parent.glob(f".{dest.name}.download-*"):
            shutil.rmtree(partial, ignore_errors=True)
        names = _names(seen, weights)
        _check_room(dest.parent, sum(seen.listing[n].size for n in names if n in seen.listing))
        started = time.monotonic()
        try:
            if weights:
                download_folder(store, dest)
            else:
                _download_configs(store, seen, names, dest)
        except CompressflowError as exc:  # the store's checks name the upload's field
            raise ModelFetchError(field, exc.problem, exc.fix) from None
        log.info(
            "Downloaded %s into %s in %.1f s",
            store.location.uri,
            dest,
            time.monotonic() - started,
        )
    return Downloaded(dest, store.location.uri, seen.manifest is not None, False)


def _names(seen: Look, weights: bool) -> list[str]:
    if seen.manifest is not None:
        names = [n for n in seen.manifest.files if n != MANIFEST]
    else:
        names = [n for n in seen.listing if not n.startswith(RESERVED) and not n.endswith("/")]
    if weights:
        return sorted(names)
    return sorted(n for n in names if "/" not in n and any(fnmatch(n, p) for p in CONFIG_PATTERNS))


def _check_room(folder: Path, size: int) -> None:
    """Refuse a download the cache's disk cannot hold, before its first byte."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < size:
        raise SettingsError(
            variable("cache_dir"),
            f"the model is {size / 2**30:.2f} GiB, but {folder} has {free / 2**30:.2f} GiB free",
            f"free space there, or set {variable('cache_dir')} to a folder on a larger disk",
        )


def _download_configs(store: ObjectStore, seen: Look, names: list[str], dest: Path) -> None:
    """Validation's share of the model (configs, tokenizer), each file checked against the
    manifest's sha256 where there is one; renamed into place once whole."""
    records = (seen.manifest.objects if seen.manifest else None) or {}
    expected = {name: record["sha256"] for name, record in records.items()}
    staging = dest.parent / f".{dest.name}.download-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for name in names:
            got = store.download(name, staging / name)
            if name in expected and got != expected[name]:
                raise ModelFetchError(
                    FIELD,
                    f"{store.location.uri}: {name} downloaded with other bytes than its manifest "
                    "records",
                    "download again; if it recurs, publish the model again",
                )
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
