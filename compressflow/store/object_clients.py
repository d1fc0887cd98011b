"""What a store of published models must do, one small interface, and its plain-folder kind.

`ObjectStore` is what the commit (`compressflow.store.objects`) needs of a store: list a prefix
(name, size, etag per object; an etag changes whenever an object is written again), read and
write small objects with conditions (the lease), upload a file streaming and checked, tell
whether an object holds given bytes, download one, delete one, and a cheap probe that it can be
written. Names are relative to the prefix. The S3 kind is `compressflow.store.object_s3`.

`FileStore` (`file://`) is a folder laid out exactly as a published output folder; its lease,
the lock that makes its conditional writes atomic and its files being written lie beside it
(hidden names, as the local output lock's), never in it. A file is written beside, read back and
hashed (a folder keeps no checksum), then renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from compressflow.errors import InputError, PublishError
from compressflow.store.identity import CHUNK_BYTES, file_sha256
from compressflow.store.object_uri import ObjectLocation

RESERVED = ".compressflow-"  # names of ours beside the model's files: the lease, a probe


class Conflict(Exception):
    """A conditional write or delete found the object other than the condition said."""


@dataclass(frozen=True)
class StoredObject:
    size: int
    etag: str


@dataclass(frozen=True)
class Small:
    """A small object read whole: its bytes, its etag, and its age by the store's own clock."""

    data: bytes
    etag: str
    age_seconds: float


def changed_locally(path: Path, name: str) -> PublishError:
    return PublishError(
        "output.upload_uri",
        f"{path} ({name}) is no longer what its manifest records: it changed after the output "
        "was sealed, so it was not uploaded",
        "find out what writes into the published folder, then publish it again",
    )


class ObjectStore(ABC):
    """One prefix of a store; see the module's docstring."""

    def __init__(self, location: ObjectLocation):
        self.location = location

    @abstractmethod
    def list(self) -> dict[str, StoredObject]: ...

    @abstractmethod
    def read(self, name: str, limit: int) -> Small | None:
        """The object whole (None when absent); a PublishError past `limit` bytes."""

    @abstractmethod
    def write(self, name: str, data: bytes, *, if_absent: bool = False, if_match: str = "") -> str:
        """Write a small object, checked; its etag. Conflict when the condition fails."""

    @abstractmethod
    def delete(self, name: str, if_match: str = "") -> None:
        """Delete (nothing when absent); Conflict when `if_match` is not its etag."""

    @abstractmethod
    def upload(self, name: str, path: Path, sha256: str) -> StoredObject:
        """Upload `path` streaming; a PublishError unless the object holds exactly the bytes
        whose sha256 (hex) is `sha256`."""

    @abstractmethod
    def holds(self, name: str, sha256: str) -> bool:
        """Whether the object is there with exactly the bytes of that sha256 (hex)."""

    @abstractmethod
    def download(self, name: str, dest: Path) -> str:
        """Write the object to `dest` (streaming); the sha256 (hex) of what was written."""

    @abstractmethod
    def clean_incomplete(self) -> None:
        """Remove what cut uploads left that no listing shows (parts, files being written)."""

    @abstractmethod
    def probe(self, field: str) -> None:
        """Refuse, with an InputError naming `field`, a store this worker cannot write."""


def _hash_copy(source, dest) -> str:
    digest = hashlib.sha256()
    while chunk := source.read(CHUNK_BYTES):
        digest.update(chunk)
        dest.write(chunk)
    return digest.hexdigest()


class FileStore(ObjectStore):
    def __init__(self, location: ObjectLocation):
        super().__init__(location)
        self.root = Path(location.prefix)

    def _path(self, name: str) -> Path:
        if name.startswith(RESERVED):  # beside the folder, which stays a plain output folder
            return self.root.parent / f".{self.root.name}{name}"
        return self.root / name

    def _tmp(self) -> Path:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        return self.root.parent / f".{self.root.name}.upload-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Conditional writes are read-compare-rename under this lock (flock: across processes
        of a host and on NFSv4)."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path(RESERVED + "lease.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def _etag(path: Path) -> str:
        info = path.lstat()
        return f"{info.st_size}:{info.st_mtime_ns}:{info.st_ino}"

    def list(self) -> dict[str, StoredObject]:
        if self.root.is_file() or self.root.is_symlink():
            raise InputError(
                "output.upload_uri",
                f"{self.location.uri} is a file or a link, not a folder",
                "choose a file:// URI that names a folder, or none yet",
            )
        found = {}
        for folder, _, files in os.walk(self.root):
            for file in files:
                path = Path(folder, file)
                name = path.relative_to(self.root).as_posix()
                # A link or a FIFO is listed (it is in the way) with an etag nothing matches.
                regular = path.is_file() and not path.is_symlink()
                size = path.lstat().st_size
                found[name] = StoredObject(size, self._etag(path) if regular else "not-a-file")
        return found

    def read(self, name: str, limit: int) -> Small | None:
        path = self._path(name)
        try:
            if path.is_symlink() or not path.is_file():
                return None
            if path.stat().st_size > limit:
                raise PublishError(
                    "output.upload_uri",
                    f"{self.location.uri}: {name} is larger than any compressflow writes",
                    "remove it, or choose another upload_uri",
                )
            etag, data = self._etag(path), path.read_bytes()
            return Small(data, etag, time.time() - path.stat().st_mtime)
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes, *, if_absent: bool = False, if_match: str = "") -> str:
        path, tmp = self._path(name), self._tmp()
        tmp.write_bytes(data)
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        try:
            with self._locked():
                exists = os.path.lexists(path)
                if (if_absent and exists) or (if_match and self._etag_or_none(path) != if_match):
                    raise Conflict(name)
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, path)
                return self._etag(path)
        finally:
            tmp.unlink(missing_ok=True)

    def _etag_or_none(self, path: Path) -> str | None:
        try:
            return self._etag(path)
        except FileNotFoundError:
            return None

    def delete(self, name: str, if_match: str = "") -> None:
        path = self._path(name)
        with self._locked():
            etag = self._etag_or_none(path)
            if if_match and etag not in (None, if_match):
                raise Conflict(name)
            path.unlink(missing_ok=True)
        for parent in Path(name).parents:  # folders the model's files made, once empty
            if str(parent) != ".":
                try:
                    (self.root / parent).rmdir()
                except OSError:
                    pass

    def upload(self, name: str, path: Path, sha256: str) -> StoredObject:
        tmp = self._tmp()
        try:
            with path.open("rb") as source, tmp.open("wb") as dest:
                sent = _hash_copy(source, dest)
                dest.flush()
                os.fsync(dest.fileno())
            if sent != sha256:
                raise changed_locally(path, name)
            if file_sha256(tmp).hex() != sha256:  # read back: a plain folder keeps no checksum
                raise PublishError(
                    "output.upload_uri",
                    f"{self.location.uri}: {name} read back other bytes than were written",
                    "check the disk behind that folder (dmesg, the file system's health), then "
                    "publish again",
                )
            target = self._path(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, target)
            return StoredObject(target.stat().st_size, self._etag(target))
        finally:
            tmp.unlink(missing_ok=True)

    def holds(self, name: str, sha256: str) -> bool:
        path = self._path(name)
        if path.is_symlink() or not path.is_file():
            return False
        return file_sha256(path).hex() == sha256

    def download(self, name: str, dest: Path) -> str:
        with self._path(name).open("rb") as source, dest.open("wb") as out:
            return _hash_copy(source, out)

    def clean_incomplete(self) -> None:
        # Under the lease: any file still being written belongs to a holder whose lease expired.
        for tmp in self.root.parent.glob(f".{self.root.name}.upload-*"):
            tmp.unlink(missing_ok=True)

    def probe(self, field: str) -> None:
        existing = next(p for p in (self.root, *self.root.parents) if p.exists())
        if not existing.is_dir():
            raise InputError(
                field,
                f"{self.location.uri} lies under {existing}, which is a file, not a folder",
                "choose a file:// URI whose folders are folders",
            )
        probe = existing / f".compressflow-probe-{uuid.uuid4().hex[:8]}"
        try:
            probe.write_bytes(b"probe")
            probe.unlink()
        except OSError as exc:
            raise InputError(
                field,
                f"{self.location.uri}: this worker (uid {os.getuid()}) cannot write in "
                f"{existing} ({exc.strerror})",
                "choose a folder the worker may write to, or make it writable for that user",
            ) from None
