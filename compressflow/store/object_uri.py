"""Where a published model goes in object storage: `output.upload_uri`, parsed and refused early.

Two schemes are accepted, each covered by tests: `s3://bucket/prefix` (AWS or any S3-compatible
endpoint, named by `AWS_ENDPOINT_URL` or an AwsCredentials block) and `file:///abs/path` (a plain
folder: a shared disk is the simplest store). The URI is the exact prefix the model's files go
to, so it must name one: no bucket root, no `.` or `..` segment, no query or fragment. Other
fsspec schemes are refused until a test covers them. A URI is never echoed when it holds
`user:password@`: credentials belong in the environment or a block, never in a parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

from compressflow.errors import InputError

SCHEMES = ("s3", "file")
# Schemes fsspec knows that we do not write to yet: named so the refusal says "not yet", not "?".
LATER = ("gs", "gcs", "az", "abfs", "abfss", "adl", "hf", "http", "https", "hdfs", "sftp", "ftp")
MAX_URI = 1024  # an S3 key's limit; a prefix leaves room for the file names under it
MAX_PREFIX_BYTES = 768
# S3's bucket naming rules (also R2's, MinIO's and Ceph's): 3-63 lower-case letters, digits,
# dots and hyphens, starting and ending with a letter or digit, not shaped like an IP address.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IP = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
_FIX = "write it as s3://BUCKET/PREFIX or file:///ABSOLUTE/PATH"


@dataclass(frozen=True)
class ObjectLocation:
    """A parsed upload URI: `scheme` 's3' (bucket, key prefix without a trailing '/') or 'file'
    (prefix is the absolute folder, bucket empty); `uri` is the normalised form."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def uri(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}"
        return f"file://{self.prefix}"


def parse_upload_uri(uri: object, field: str = "output.upload_uri") -> ObjectLocation:
    """The location `uri` names, or an InputError naming `field`, the problem and the fix."""

    def refuse(problem: str, fix: str = _FIX) -> InputError:
        return InputError(field, problem, fix)

    if not isinstance(uri, str) or not uri.strip():
        raise refuse("is empty or not text")
    if len(uri) > MAX_URI:
        raise refuse(f"is {len(uri)} characters long, past the {MAX_URI} an object key may have")
    if re.search(r"[\x00-\x20\x7f]", uri):
        raise refuse("holds a space, a newline or another control character")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if "@" in parts.netloc:
        raise refuse(
            "holds credentials (user:password@ before the host); they are not shown here",
            "remove them from the URI and give them as AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY in the worker's environment or in an AwsCredentials block",
        )
    if not scheme:
        raise refuse(f"{uri!r} has no scheme", f"for a local folder write file://{uri}")
    if scheme not in SCHEMES:
        later = scheme in LATER
        raise refuse(
            f"{uri!r} uses the {scheme}:// scheme, "
            + ("which compressflow does not upload to yet" if later else "which is not known"),
            f"use s3:// (AWS or an S3-compatible store: MinIO, Ceph, R2) or file://; {_FIX}",
        )
    if parts.query or parts.fragment or uri.endswith(("?", "#")):
        raise refuse(f"{uri!r} has a query or a fragment (?... or #...), which no prefix has")
    if scheme == "s3":
        return _s3(uri, parts.netloc, parts.path, refuse)
    return _file(uri, parts.netloc, parts.path, refuse)


def _segments(uri: str, path: str, refuse) -> list[str]:
    segments = path.strip("/").split("/")
    if segments == [""]:
        raise refuse(f"{uri!r} names no prefix: a model needs a prefix of its own")
    if "" in segments:
        raise refuse(f"{uri!r} has an empty segment (//)")
    if {".", ".."} & set(segments):
        raise refuse(f"{uri!r} has a . or .. segment, which stores read differently")
    return segments


def _s3(uri: str, bucket: str, path: str, refuse) -> ObjectLocation:
    if ":" in bucket:
        raise refuse(
            f"{uri!r} names a host and port, not a bucket",
            "write s3://BUCKET/PREFIX and set the endpoint in AWS_ENDPOINT_URL or in the "
            "AwsCredentials block's aws_client_parameters.endpoint_url",
        )
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IP.fullmatch(bucket):
        raise refuse(
            f"{uri!r}: {bucket!r} is not a valid bucket name",
            "bucket names are 3 to 63 lower-case letters, digits, dots and hyphens, starting "
            "and ending with a letter or digit",
        )
    prefix = "/".join(_segments(uri, path, refuse))
    if len(prefix.encode()) > MAX_PREFIX_BYTES:
        raise refuse(
            f"{uri!r}'s prefix is {len(prefix.encode())} bytes, past {MAX_PREFIX_BYTES}: the "
            "file names under it would pass S3's 1024-byte key limit",
            "choose a shorter prefix",
        )
    return ObjectLocation("s3", bucket, prefix)


def _file(uri: str, host: str, path: str, refuse) -> ObjectLocation:
    if host not in ("", "localhost"):
        raise refuse(
            f"{uri!r} names the host {host!r}; file:// URIs name a folder of this worker",
            "write file:///ABSOLUTE/PATH (three slashes)",
        )
    folder = unquote(path)
    if not folder.startswith("/"):
        raise refuse(f"{uri!r} is not an absolute path", "write file:///ABSOLUTE/PATH")
    segments = _segments(uri, folder, refuse)
    return ObjectLocation("file", "", str(PurePosixPath("/", *segments)))
