"""Publishing to object storage as a commit: a sealed folder's files to a prefix, the manifest
last, and reading a prefix back only when it holds exactly what its manifest says.

The contract is the local one (`compressflow.store.staging`: seal a folder, manifest last) with
a prefix in the folder's place (`output.upload_uri`, parsed by `compressflow.store.object_uri`):

- `commit_folder` uploads every file of a sealed folder (its `manifest.json` lists them in
  `files` and records the sha256 of each in `file_sha256`), each object checked after upload
  (`compressflow.store.object_clients` / `object_s3`), then the manifest, with `objects`: the
  size, etag and sha256 of each object as uploaded. A reader trusts a prefix by a listing and
  that one read: every object there with the etag recorded, nothing else beside them.
- A prefix that already holds this output intact costs a listing and a manifest read and sends
  nothing; one holding part of it (a cut upload, an object corrupted since) gets only the files
  that are missing or wrong.
- A prefix is owned as a folder is: objects no manifest and no lease of ours names are never
  replaced, and refused; `overwrite` replaces an earlier output of ours, deleting only what its
  manifest lists. Two runs never write one prefix at once (`compressflow.store.object_lease`):
  the second waits, bounded by COMPRESSFLOW_LOCK_TIMEOUT_SECONDS as the local lock does, then
  looks again: the first run's upload of the same output is reused without a byte sent, any
  other is judged as it finds it (refused, or replaced with `overwrite`).
- `read_published` and `download_folder` treat a prefix whose objects disagree with its
  manifest as absent; `probe` is `validate`'s cheap check that the store can be written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from compressflow.errors import InputError, PublishError
from compressflow.limits import MAX_JSON_BYTES
from compressflow.logs import run_logger
from compressflow.settings import settings
from compressflow.store.identity import file_sha256
from compressflow.store.manifest import MANIFEST
from compressflow.store.object_clients import RESERVED, FileStore, ObjectStore, StoredObject
from compressflow.store.object_lease import LEASE_SECONDS, Lease, describe, leased
from compressflow.store.object_uri import parse_upload_uri

URI_FIELD = "output.upload_uri"
BLOCK_FIELD = "output.upload_credentials"
OBJECTS = "objects"  # what the uploaded manifest adds: each object as uploaded
POLL_SECONDS = 2.0


def open_store(uri: str, credentials_block: str = "", field: str = URI_FIELD) -> ObjectStore:
    """The store of `uri` (refused as `parse_upload_uri` says); for s3:// with the credentials
    of the AwsCredentials block named `credentials_block`, or else the worker's environment."""
    location = parse_upload_uri(uri, field)
    if location.scheme == "file":
        return FileStore(location)
    from compressflow.store.object_s3 import open_s3

    return open_s3(location, credentials_block, BLOCK_FIELD)


def _store(target: str | ObjectStore, credentials_block: str) -> ObjectStore:
    return target if isinstance(target, ObjectStore) else open_store(target, credentials_block)


def _plain(name: object) -> bool:
    """A name a manifest may list: relative, no `.`/`..`, not one of our reserved names."""
    if not isinstance(name, str) or not name or name.startswith(RESERVED):
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and str(path) == name and not {".", ".."} & set(path.parts)


@dataclass
class Listed:
    """What a manifest (local, or uploaded) says was published; `objects` only uploaded ones."""

    files: list[str]
    file_sha256: dict[str, str]
    run_key: str | None
    body: dict
    objects: dict[str, dict] | None = None

    def same_output(self, other: Listed) -> bool:
        return (self.run_key, self.file_sha256, set(self.files)) == (
            other.run_key,
            other.file_sha256,
            set(other.files),
        )


def parse_manifest(data: bytes) -> Listed | None:
    """The fields of a manifest the commit needs (`compressflow.store.manifest.Manifest` names
    them), or None when it is not a manifest that records the sha256 of its files."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    files, digests = body.get("files"), body.get("file_sha256")
    if not isinstance(files, list) or not isinstance(digests, dict):
        return None
    if not all(map(_plain, files)) or not set(digests) <= set(files):
        return None
    if not all(isinstance(v, str) for v in digests.values()):
        return None
    result = body.get("result")
    run_key = result.get("run_key") if isinstance(result, dict) else None
    objects = body.pop(OBJECTS, None)
    return Listed(files, digests, run_key, body, objects if isinstance(objects, dict) else None)


@dataclass
class Look:
    """A prefix as one listing and one manifest read found it."""

    listing: dict[str, StoredObject]
    manifest: Listed | None
    manifest_found: bool  # an object is at the manifest's name, readable or not
    departures: list[str] = field(default_factory=list)  # why it is not intact; [] when it is


def look(store: ObjectStore, manifest_name: str = MANIFEST) -> Look:
    """List the prefix, read its manifest, and say how it departs from what the manifest
    recorded on upload; nothing else is read."""
    listing = store.list()
    small = store.read(manifest_name, MAX_JSON_BYTES) if manifest_name in listing else None
    manifest = parse_manifest(small.data) if small else None
    seen = Look(listing, manifest, manifest_name in listing)
    if small is None:
        seen.departures = [f"no {manifest_name}"]
    elif manifest is None or manifest.objects is None:
        seen.departures = [f"{manifest_name} is not one compressflow uploaded"]
    else:
        seen.departures = _departures(listing, manifest, manifest_name)
    return seen


def _departures(listing: dict[str, StoredObject], manifest: Listed, manifest_name: str) -> list:
    found = []
    for name in sorted(set(manifest.files) - {manifest_name}):
        record, stored = manifest.objects.get(name), listing.get(name)
        if stored is None:
            found.append(f"{name}: missing")
        elif not _recorded(manifest, name):
            found.append(f"{name}: not recorded as uploaded")
        elif (stored.etag, stored.size) != (record["etag"], record["size"]):
            found.append(f"{name}: other bytes (written again since it was published)")
    ours = set(manifest.files) | {manifest_name}
    found += [f"{name}: added" for name in sorted(listing) if name not in ours and not _ours(name)]
    return found


def _recorded(manifest: Listed, name: str) -> bool:
    """Whether the upload record of `name` is whole and agrees with the manifest's sha256."""
    record = (manifest.objects or {}).get(name)
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        return False
    return record["sha256"] == manifest.file_sha256.get(name, record["sha256"])


def _ours(name: str) -> bool:
    return name.startswith(RESERVED)


@dataclass
class Commit:
    """What `commit_folder` did: `reused` when the prefix already held this output intact."""

    uri: str
    reused: bool
    manifest: dict
    sent: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # already there intact (a resumed upload)
    deleted: list[str] = field(default_factory=list)
    bytes_sent: int = 0


def read_local(folder: Path, manifest_name: str = MANIFEST) -> Listed:
    """The sealed folder's manifest; a PublishError when it does not say what to upload."""
    path = folder / manifest_name
    listed = parse_manifest(path.read_bytes()) if path.is_file() else None
    if listed is None or manifest_name not in listed.files:
        raise PublishError(
            URI_FIELD,
            f"{folder} holds no {manifest_name} listing its files and their sha256, so it is "
            "not a sealed output",
            "upload only a folder compressflow published (publish seals it with its manifest)",
        )
    missing = [name for name in listed.files if not (folder / name).is_file()]
    if missing:
        raise PublishError(
            URI_FIELD,
            f"{folder} lacks files its manifest lists ({', '.join(missing[:3])})",
            "publish the output again; a published folder must not be changed",
        )
    return listed


def commit_folder(
    folder: Path,
    target: str | ObjectStore,
    *,
    manifest_name: str = MANIFEST,
    overwrite: bool = False,
    credentials_block: str = "",
    wait_seconds: float | None = None,
    lease_seconds: float = LEASE_SECONDS,
) -> Commit:
    """Upload the sealed `folder` to the prefix `target` (a URI, or an open store), the
    manifest last; see the module's docstring. `wait_seconds` bounds the wait for another run's
    lease (default: COMPRESSFLOW_LOCK_TIMEOUT_SECONDS)."""
    store, log = _store(target, credentials_block), run_logger(__name__)
    local = read_local(folder, manifest_name)
    wait = settings().lock_timeout_seconds if wait_seconds is None else wait_seconds
    started, last = time.monotonic(), None
    while True:
        seen = look(store, manifest_name)
        if reused := _reused(store, seen, local):
            return reused
        lease = Lease.take(store, local.run_key or "", lease_seconds)
        if isinstance(lease, Lease):
            break
        waited = time.monotonic() - started
        if waited >= wait:
            raise PublishError(
                URI_FIELD,
                f"{store.location.uri} is still being uploaded to by {describe(lease)} after "
                f"waiting {waited:.0f} s",
                "let that run finish or cancel it, choose another upload_uri, or raise "
                "COMPRESSFLOW_LOCK_TIMEOUT_SECONDS",
            )
        if lease != last:
            log.info("Waiting for %s: %s uploads to it", store.location.uri, describe(lease))
            last = lease
        time.sleep(min(POLL_SECONDS, max(wait - waited, 0.01)))
    published = False
    try:
        seen = look(store, manifest_name)  # again: the prefix may have changed before the lease
        if not (reused := _reused(store, seen, local)):
            reused = _upload(store, lease, folder, local, seen, overwrite, manifest_name)
        published = True
        return reused
    finally:
        lease.release(published)


def _reused(store: ObjectStore, seen: Look, local: Listed) -> Commit | None:
    if seen.departures or not seen.manifest.same_output(local):
        return None
    run_logger(__name__).info("%s already holds this output, intact", store.location.uri)
    return Commit(store.location.uri, True, seen.manifest.body)


def _upload(
    store: ObjectStore,
    lease: Lease,
    folder: Path,
    local: Listed,
    seen: Look,
    overwrite: bool,
    manifest_name: str,
) -> Commit:
    remote, uri = seen.manifest, store.location.uri
    owned = lease.inherited() | set(remote.files if remote else [])
    refuse_foreign(store, seen, owned)
    # An output other than this one, published whole: replaced only when asked. A partial
    # upload (no manifest: a cut run's) is compressflow's leftovers, replaced without asking.
    if remote and not remote.same_output(local) and not overwrite:
        raise PublishError(
            URI_FIELD,
            f"{uri} already holds another compressflow output (run key "
            f"{(remote.run_key or '?')[:12]})",
            "choose another upload_uri, or set output.overwrite: true to replace it (only the "
            "objects its manifest lists are deleted)",
        )
    lease.claim(owned | set(local.files))  # before the first write, what this run may leave
    store.clean_incomplete()
    if seen.manifest_found:  # from here on a reader finds no manifest, so no output
        store.delete(manifest_name)
    done = Commit(uri, False, local.body)
    record = {}
    for name in sorted(set(local.files) - {manifest_name}):
        lease.check()
        path = folder / name
        sha256 = local.file_sha256.get(name) or file_sha256(path).hex()
        if name in seen.listing and _intact(seen, name, sha256, store):
            stored = seen.listing[name]
            done.kept.append(name)
        else:
            stored = store.upload(name, path, sha256)
            done.sent.append(name)
            done.bytes_sent += stored.size
        record[name] = {"size": stored.size, "etag": stored.etag, "sha256": sha256}
    for name in sorted(owned - set(local.files)):
        if name in seen.listing:
            store.delete(name)
            done.deleted.append(name)
    lease.renew()  # still ours: no other run has written here since
    body = {**local.body, OBJECTS: record}
    store.write(manifest_name, json.dumps(body, indent=2).encode())
    run_logger(__name__).info(
        "Uploaded %s: %d files sent (%.1f MB), %d already there intact",
        uri,
        len(done.sent),
        done.bytes_sent / 1e6,
        len(done.kept),
    )
    return done


def _intact(seen: Look, name: str, sha256: str, store: ObjectStore) -> bool:
    """Whether the object already there holds these bytes: by the upload record when the
    manifest there has one and the object was not written since, else by the store."""
    if seen.manifest and _recorded(seen.manifest, name):
        record, stored = seen.manifest.objects[name], seen.listing[name]
        if (stored.etag, stored.size) == (record["etag"], record["size"]):
            return record["sha256"] == sha256
    return store.holds(name, sha256)


def check_published(target: str | ObjectStore, credentials_block: str = "") -> tuple:
    """(the manifest, None) of a prefix holding an output intact, else (None, why not)."""
    seen = look(_store(target, credentials_block))
    if seen.departures:
        listed = "; ".join(seen.departures[:3]) + ("; ..." if len(seen.departures) > 3 else "")
        return None, listed
    return seen.manifest.body, None


def read_published(target: str | ObjectStore, credentials_block: str = "") -> dict | None:
    """The manifest of the output published at `target` (as `manifest.json` holds it), or None
    when there is none intact: no manifest, or objects that disagree with it (the reason is
    logged; `check_published` returns it)."""
    manifest, why = check_published(target, credentials_block)
    if manifest is None:
        run_logger(__name__).info("No output published intact at %s: %s", _uri(target), why)
    return manifest


def _uri(target: str | ObjectStore) -> str:
    return target.location.uri if isinstance(target, ObjectStore) else target


def download_folder(
    target: str | ObjectStore, dest: Path, credentials_block: str = ""
) -> dict | None:
    """Download the prefix `target` into the new folder `dest`; its manifest, or None.

    A prefix with a manifest of ours is downloaded only when intact, and each file is checked
    against the sha256 the manifest records (a PublishError otherwise, and `dest` is not
    made). A prefix without one (a model that is not ours, uploaded by other tools) is
    downloaded as it is: nothing can be checked beyond the store's own transfer checksums. The
    files are written into a hidden folder beside `dest`, renamed to `dest` when complete.
    """
    if os.path.lexists(dest) and not (dest.is_dir() and not any(dest.iterdir())):
        raise InputError(
            "dest", f"{dest} already exists", "download into a folder that does not exist yet"
        )
    store = _store(target, credentials_block)
    uri, seen = store.location.uri, look(store)
    names = sorted(n for n in seen.listing if not _ours(n) and not n.endswith("/"))
    if not names:
        raise InputError(URI_FIELD, f"{uri} holds no objects", "check the URI")
    expected: dict[str, str] = {}
    if seen.manifest_found:
        if seen.departures:
            raise PublishError(
                URI_FIELD,
                f"{uri} holds an output whose objects disagree with its manifest "
                f"({'; '.join(seen.departures[:3])}): it is not read",
                "publish it again (a rerun sends only what is missing or wrong)",
            )
        names = sorted(set(seen.manifest.files) - {MANIFEST})
        expected = {n: record["sha256"] for n, record in seen.manifest.objects.items()}
    unsafe = [n for n in names if not _plain(n)]
    if unsafe:
        raise InputError(
            URI_FIELD,
            f"{uri} holds objects whose names are no plain relative paths ({unsafe[0]!r})",
            "copy the model to a prefix whose names are plain paths",
        )
    staging = dest.parent / f".{dest.name}.download-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        for name in names:
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            got = store.download(name, path)
            if name in expected and got != expected[name]:
                raise PublishError(
                    URI_FIELD,
                    f"{uri}: {name} downloaded with other bytes than its manifest records",
                    "download again; if it recurs, publish the output again",
                )
        if seen.manifest:
            (staging / MANIFEST).write_text(json.dumps(seen.manifest.body, indent=2))
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return seen.manifest.body if seen.manifest else None


def refuse_foreign(store: ObjectStore, seen: Look, owned: set[str]) -> None:
    """Refuse a prefix holding objects that neither its manifest nor an upload's lease names
    (`owned`): compressflow never writes over, or beside, what it did not publish."""
    foreign = [n for n in sorted(seen.listing) if n not in owned and not _ours(n)]
    if foreign:
        raise InputError(
            URI_FIELD,
            f"{store.location.uri} holds {len(foreign)} objects compressflow did not publish "
            f"there ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})",
            "choose another upload_uri, or remove those objects yourself; overwrite replaces "
            "only an earlier compressflow output, never other objects",
        )


def probe(uri: str, credentials_block: str = "", field: str = URI_FIELD) -> None:
    """`validate`'s pre-flight: refuse, with an InputError naming the field and the fix, a URI
    that does not parse, a bucket that does not exist, credentials that are wrong or expired,
    a prefix this worker may not write (a small probe object is written, then deleted), and one
    holding objects compressflow did not publish there: before calibrating, not after."""
    store = open_store(uri, credentials_block, field)
    store.probe(field)
    seen = look(store)
    refuse_foreign(store, seen, set(seen.manifest.files if seen.manifest else []) | leased(store))
