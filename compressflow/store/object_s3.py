"""The S3 store (boto3): AWS or any S3-compatible endpoint (MinIO, Ceph, R2, moto's server).

Credentials and the endpoint come from the worker's environment as boto3 reads them
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`...) or from a prefect-aws
`AwsCredentials` block named by a parameter; they are never logged nor put in an error.

A file uploads in parts of `PART_BYTES` sent on `THREADS` threads, each part with its SHA-256
(the server refuses a part that arrives otherwise): memory is bounded by THREADS + 1 parts,
whatever the file's size. The object's checksum (S3's composite `base64(sha256(part
digests))-N` for a multipart object) is computed while streaming and compared with the one the
server keeps; a server that keeps none has the object read back and hashed. The upload is
completed only once the whole file's sha256 is the one its manifest records, and each object
carries that sha256 in its metadata, which a resumed upload reads to tell an object it may keep.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path

from compressflow.errors import CompressflowError, InputError, PublishError
from compressflow.store.identity import CHUNK_BYTES
from compressflow.store.object_clients import (
    RESERVED,
    Conflict,
    ObjectStore,
    Small,
    StoredObject,
    changed_locally,
)
from compressflow.store.object_uri import ObjectLocation

PART_BYTES = 8 << 20  # S3's parts are 5 MiB at least; 8 MiB keeps 4 in flight within 40 MB
MAX_PARTS = 9_000  # S3 allows 10,000: larger files get larger parts
THREADS = 4
SHA256_META = "compressflow-sha256"  # user metadata: the file's sha256, set on upload


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def same_checksum(stored: str, computed: str) -> bool:
    """S3's checksums: AWS suffixes a composite one with `-<parts>`, some servers do not."""
    stored_base, _, stored_parts = stored.partition("-")
    base, _, parts = computed.partition("-")
    return stored_base == base and (not stored_parts or stored_parts == parts)


def part_bytes(size: int) -> int:
    """The part size for a file of `size` bytes: PART_BYTES, or whole MiB within MAX_PARTS."""
    return max(PART_BYTES, -(-size // MAX_PARTS // (1 << 20)) << 20)


class S3Store(ObjectStore):
    def __init__(self, location: ObjectLocation, client, credentials_field: str = ""):
        """`credentials_field`: the parameter naming the AwsCredentials block the client was
        made from; empty when it came from the worker's environment."""
        super().__init__(location)
        self.client, self.bucket = client, location.bucket
        self.credentials_field = credentials_field

    def _key(self, name: str) -> str:
        return f"{self.location.prefix}/{name}"

    def list(self) -> dict[str, StoredObject]:
        start = len(self.location.prefix) + 1
        found = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key("")
        )
        for page in pages:
            for item in page.get("Contents", []):
                found[item["Key"][start:]] = StoredObject(item["Size"], item["ETag"])
        return found

    def read(self, name: str, limit: int) -> Small | None:
        from botocore.exceptions import ClientError

        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        with answer["Body"] as body:
            if answer["ContentLength"] > limit:
                raise PublishError(
                    "output.upload_uri",
                    f"{self.location.uri}: {name} is larger than any compressflow writes",
                    "remove it, or choose another upload_uri",
                )
            data = body.read()
        # The store's clock for both ends: a worker's skewed clock cannot make a lease stale.
        date = answer["ResponseMetadata"]["HTTPHeaders"].get("date")
        now = parsedate_to_datetime(date) if date else None
        age = (now - answer["LastModified"]).total_seconds() if now else 0.0
        return Small(data, answer["ETag"], age)

    def write(self, name: str, data: bytes, *, if_absent: bool = False, if_match: str = "") -> str:
        from botocore.exceptions import ClientError

        condition = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_match} if if_match else {}
        try:
            answer = self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(name),
                Body=data,
                ChecksumSHA256=b64(hashlib.sha256(data).digest()),
                **condition,
            )
        except ClientError as exc:
            if error_code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
                raise Conflict(name) from None
            raise
        return answer["ETag"]

    def delete(self, name: str, if_match: str = "") -> None:
        from botocore.exceptions import ClientError

        try:
            condition = {"IfMatch": if_match} if if_match else {}
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name), **condition)
        except ClientError as exc:
            if error_code(exc) in ("PreconditionFailed", "412"):
                raise Conflict(name) from None
            if error_code(exc) not in ("NoSuchKey", "404"):
                raise

    def upload(self, name: str, path: Path, sha256: str) -> StoredObject:
        key, size = self._key(name), path.stat().st_size
        metadata = {SHA256_META: sha256}
        if size <= PART_BYTES:
            data = path.read_bytes()
            digest = hashlib.sha256(data).digest()
            if digest.hex() != sha256:
                raise changed_locally(path, name)
            checksum = b64(digest)
            answer = self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ChecksumSHA256=checksum, Metadata=metadata
            )
        else:
            answer, checksum = self._multipart(key, path, sha256, metadata)
        self._confirm(name, answer.get("ChecksumSHA256"), checksum, sha256)
        return StoredObject(size, answer["ETag"])

    def _multipart(self, key: str, path: Path, sha256: str, metadata: dict) -> tuple[dict, str]:
        """Parts read one after another, sent on THREADS threads; at most THREADS + 1 parts in
        memory (the semaphore holds the reader back). The upload is aborted on any failure, and
        completed only once the whole file's sha256 is the expected one."""
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata=metadata
        )["UploadId"]
        whole, digests, futures = hashlib.sha256(), [], []
        room, step = threading.BoundedSemaphore(THREADS), part_bytes(path.stat().st_size)

        def send(number: int, data: bytes, checksum: str) -> dict:
            try:
                answer = self.client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload,
                    PartNumber=number,
                    Body=data,
                    ChecksumSHA256=checksum,
                )
                return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumSHA256": checksum}
            finally:
                room.release()

        try:
            with path.open("rb", buffering=0) as source, ThreadPoolExecutor(THREADS) as pool:
                while True:
                    room.acquire()
                    data = source.read(step)
                    if not data:
                        room.release()
                        break
                    whole.update(data)
                    digests.append(hashlib.sha256(data).digest())
                    futures.append(pool.submit(send, len(digests), data, b64(digests[-1])))
                    del data  # the part's only reference is now the thread's
                parts = [future.result() for future in futures]
            if whole.hexdigest() != sha256:
                raise changed_locally(path, key)
            answer = self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise
        return answer, f"{b64(hashlib.sha256(b''.join(digests)).digest())}-{len(digests)}"

    def _confirm(self, name: str, answered: str | None, computed: str, sha256: str) -> None:
        """Compare the checksum the store keeps with the one computed while sending; where the
        store keeps none, read the object back."""
        stored = answered or self._head(name).get("ChecksumSHA256")
        if stored is not None:
            intact = same_checksum(stored, computed)
        else:
            intact = self._read_back(name) == sha256
        if not intact:
            self.delete(name)
            raise PublishError(
                "output.upload_uri",
                f"{self.location.uri}: {name} was stored with other bytes than were sent (the "
                "store's checksum disagrees), so it was deleted and nothing was published",
                "publish again; if it recurs, check the endpoint (a proxy rewriting bodies?)",
            )

    def _head(self, name: str) -> dict:
        return self.client.head_object(
            Bucket=self.bucket, Key=self._key(name), ChecksumMode="ENABLED"
        )

    def _read_back(self, name: str) -> str:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        digest = hashlib.sha256()
        for chunk in body.iter_chunks(CHUNK_BYTES):
            digest.update(chunk)
        return digest.hexdigest()

    def holds(self, name: str, sha256: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            head = self._head(name)
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return False
            raise
        stored = head.get("ChecksumSHA256")
        if stored is None:
            return self._read_back(name) == sha256
        if "-" not in head["ETag"]:  # one part: the store's checksum is the whole file's
            return same_checksum(stored, b64(bytes.fromhex(sha256)))
        # Multipart: the store checked every part against its digest on arrival, and upload()
        # completed it only once the whole file's sha256, which it records here, was right.
        return head.get("Metadata", {}).get(SHA256_META) == sha256

    def download(self, name: str, dest: Path) -> str:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        digest = hashlib.sha256()
        with dest.open("wb") as out:
            for chunk in body.iter_chunks(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()

    def clean_incomplete(self) -> None:
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self._key("")
        )
        for page in pages:
            for upload in page.get("Uploads", []):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )

    def probe(self, field: str) -> None:
        where, step = self.location.uri, "list"
        creds_field = self.credentials_field or field
        creds = (
            f"the AwsCredentials block named in {self.credentials_field}"
            if self.credentials_field
            else "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the worker's "
            "environment, or name an AwsCredentials block"
        )
        try:
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(""), MaxKeys=1)
            step, name = "write", f"{RESERVED}probe-{uuid.uuid4().hex[:8]}"
            self.write(name, b"probe", if_absent=True)
            self.delete(name)
        except CompressflowError:
            raise
        except Exception as exc:  # botocore's, told apart in `refusal`
            raise refusal(
                exc,
                Place(field, creds_field, creds, where, self.bucket, step),
                InputError,
                "create the bucket (aws s3 mb s3://{bucket}), or correct the URI",
                "s3:ListBucket, s3:PutObject, s3:GetObject and s3:DeleteObject",
            ) from None


@dataclass(frozen=True)
class Place:
    """Where an S3 call failed, for its refusal: the fields to blame, how the credentials were
    given (`creds`), the prefix (`where`), its bucket, and what was being done (`step`)."""

    field: str
    creds_field: str
    creds: str
    where: str
    bucket: str
    step: str


# What a refusal says, by S3's error code: (codes, whose field, problem). A missing bucket's and
# a denied access's fixes depend on what the caller was doing: it gives them.
REFUSALS = (
    ({"NoSuchBucket"}, "bucket", "the bucket {bucket!r} of {where} does not exist"),
    (
        {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"},
        "credentials",
        "the store refused the credentials for {where} ({code}): the key is unknown or the "
        "secret wrong",
    ),
    (
        {"ExpiredToken", "TokenRefreshRequired", "RequestExpired"},
        "expired",
        "the credentials for {where} have expired ({code})",
    ),
    (
        {"AccessDenied", "AllAccessDisabled", "403"},
        "access",
        "these credentials may not {step} {where} ({code})",
    ),
)


def refusal(
    exc: Exception, place: Place, error: type, bucket_fix: str, permissions: str
) -> CompressflowError:
    """One failed S3 call in the user's words (no credentials, an unreachable endpoint, a
    missing bucket, refused or expired credentials, denied access), as `error` naming the field
    to blame and the fix; anything else names the store's own code. Never echoes a secret."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return error(
            place.creds_field,
            f"no credentials were found to {place.step} {place.where}",
            f"set {place.creds}",
        )
    if isinstance(exc, EndpointConnectionError):
        return error(
            place.field,
            f"the S3 endpoint {exc.kwargs.get('endpoint_url', '')} cannot be reached",
            "check AWS_ENDPOINT_URL (or the block's aws_client_parameters.endpoint_url) "
            "and that the store is up",
        )
    if not isinstance(exc, ClientError):
        return error(
            place.field,
            f"{place.where} cannot be reached ({type(exc).__name__}: {exc})",
            "check the URI and the store",
        )
    code = error_code(exc)
    code = "NoSuchBucket" if (code, place.step) in (("404", "list"), ("404", "read")) else code
    words = {"bucket": place.bucket, "where": place.where, "code": code, "step": place.step}
    fixes = {
        "bucket": bucket_fix.format(**words),
        "credentials": f"check {place.creds}",
        "expired": f"renew the session token in {place.creds}",
        "access": f"grant {permissions} on that prefix, or use credentials that have them",
    }
    for codes, kind, problem in REFUSALS:
        if code in codes:
            whose = place.creds_field if kind in ("credentials", "expired") else place.field
            return error(whose, problem.format(**words), fixes[kind])
    return error(
        place.field,
        f"the store answered {code or 'an error'} on trying to {place.step} {place.where}",
        "check the URI, the endpoint and the credentials",
    )


def error_code(exc) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def open_s3(
    location: ObjectLocation, credentials_block: str = "", block_field: str = ""
) -> ObjectStore:
    """The S3 store of `location`: its client takes its credentials and endpoint from
    the prefect-aws AwsCredentials block named `credentials_block` (a parameter, `block_field`,
    names the block, never a secret), or else from the worker's environment as boto3 reads it."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": 5}, max_pool_connections=THREADS + 2
    )
    if not credentials_block:
        return S3Store(location, boto3.session.Session().client("s3", config=config))
    from prefect_aws import AwsCredentials

    try:
        block = AwsCredentials.load(credentials_block)
    except ValueError:
        raise InputError(
            block_field,
            f"no AwsCredentials block is named {credentials_block!r}",
            "create it (prefect block register -m prefect_aws, then in the UI or "
            "AwsCredentials(...).save(NAME)), or correct the name",
        ) from None
    options = block.aws_client_parameters.get_params_override()
    options["config"] = options["config"].merge(config) if "config" in options else config
    if block.region_name:
        options["region_name"] = block.region_name
    client = block.get_boto3_session().client("s3", **options)
    return S3Store(location, client, block_field)
