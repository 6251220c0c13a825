"""The S3 backend of :class:`service.storage.base.Storage` (AWS S3, MinIO, SeaweedFS, ...).

Atomicity comes from S3 itself: a PUT, and the completion of a multipart upload, make an object
visible whole or not at all, so no temporary key and rename are needed (S3 has no rename anyway).
Multi-object artifacts keep publishing their manifest last, exactly as on local storage.

Every call goes through :func:`_translate_errors`, which turns what botocore raises into the
service's vocabulary: :class:`ObjectNotFound` for a missing key, :class:`StorageUnavailable` when
the endpoint cannot serve requests right now (a 503 for the API, a retry for jobs), and a
``RuntimeError`` naming the S3 error code for the rest (bad credentials, access denied, ...).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import boto3
import urllib3.exceptions
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError, NoCredentialsError
from botocore.exceptions import ConnectionError as BotoConnectionError

from service.storage.base import ObjectNotFound, Storage, StorageUnavailable, StreamedUpload

MiB = 1024 * 1024
DEFAULT_MULTIPART_THRESHOLD = 64 * MiB
DEFAULT_MULTIPART_CHUNKSIZE = 16 * MiB  # S3 needs >= 5 MiB per part; 16 MiB keeps big files under 10k parts
DEFAULT_PAGE_SIZE = 1000  # the most list_objects_v2 returns per page
DEFAULT_CHUNK = 1 * MiB
# A streamed upload: parts sent at once, and buffers told but not yet cut into parts. Their product
# with the part size bounds its memory (4 × 2 + 1 parts of 16 MiB: 144 MiB).
STREAMED_PARTS_IN_FLIGHT = 4
STREAMED_BACKLOG = 4
CHECKSUM_ALGORITHM = "CRC32"  # what s3transfer's upload_file sends by default, part by part

log = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])
# Error codes that mean "no such object". HEAD requests carry no body, so their code is the bare status.
_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
# Transient client-side statuses worth a retry rather than a hard failure.
_TRANSIENT_STATUSES = {408, 429}
# Everything a dead, slow or flaky endpoint raises. EndpointConnectionError and ConnectTimeoutError
# are botocore ConnectionErrors; ReadTimeoutError, ConnectionClosedError and ResponseStreamingError
# (a body cut mid-read) are HTTPClientErrors; a body shorter than its Content-Length is an
# IncompleteReadError; urllib3 errors can escape while a body streams.
_CONNECTIVITY_ERRORS: tuple[type[BaseException], ...] = (
    BotoConnectionError,
    HTTPClientError,
    IncompleteReadError,
    urllib3.exceptions.HTTPError,
)


def make_s3_client(
    endpoint_url: str | None,
    *,
    connect_timeout: float = 5,
    read_timeout: float = 60,
    max_attempts: int = 3,
) -> Any:
    """The one place a boto3 S3 client is built; everything else receives the client.

    Credentials and region come from the usual ``AWS_*`` environment variables (or any other source
    boto3 searches), so no secret ever passes through the service's own settings.

    Args:
        endpoint_url: an S3-compatible endpoint (MinIO, SeaweedFS); ``None`` for AWS.
        connect_timeout: seconds to open a connection; tests use a small value to fail fast.
        read_timeout: seconds to wait for a response byte.
        max_attempts: total attempts per request (botocore's "standard" retry mode).

    Returns:
        A ``botocore`` S3 client.
    """
    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"max_attempts": max_attempts, "mode": "standard"},
        signature_version="s3v4",
        # A custom endpoint is usually reached by IP or a single host name (localhost, minio), where
        # virtual-host addressing (bucket.host) cannot resolve; path style works everywhere.
        s3={"addressing_style": "path"} if endpoint_url else None,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")``; the prefix is ``""`` or ends in ``/``.

    Raises:
        ValueError: not an ``s3://`` URL with a bucket.
    """
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"expected s3://bucket/prefix, got {url!r}")
    prefix = parsed.path.strip("/")
    return parsed.netloc, f"{prefix}/" if prefix else ""


# ---------------------------------------------------------------- error translation


class BucketNotFound(StorageUnavailable):
    """The bucket does not exist: storage cannot serve anything (and a model source names nothing)."""


def _client_error(exc: ClientError, key: str | None) -> Exception:
    """The service's exception for an error answer from S3."""
    error = exc.response.get("Error", {})
    code = str(error.get("Code", "Unknown"))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code == "NoSuchBucket" or (key is None and status == 404):
        # A missing bucket is a deployment problem, not a missing object: /readyz must say so.
        return BucketNotFound(f"S3 bucket does not exist ({code}): {error.get('Message', exc)}")
    if code in _NOT_FOUND_CODES or status == 404:
        return ObjectNotFound(key)
    if status >= 500 or status in _TRANSIENT_STATUSES:
        return StorageUnavailable(f"S3 answered {status} {code}: {error.get('Message', exc)}")
    return RuntimeError(f"S3 request failed with {code} (HTTP {status}): {error.get('Message', exc)}")


class S3CredentialsMissing(StorageUnavailable):
    """This deployment has no S3 credentials: its own storage may be elsewhere, but nothing on S3
    can be read (a dataset reference's fingerprint is then left out, and its job says why)."""


def _translate(exc: BaseException, key: str | None) -> BaseException | None:
    """The service's exception for ``exc``, or ``None`` when it is not a storage error."""
    if isinstance(exc, ClientError):
        return _client_error(exc, key)
    if isinstance(exc, _CONNECTIVITY_ERRORS):
        return StorageUnavailable(f"S3 endpoint unreachable: {exc}")
    if isinstance(exc, NoCredentialsError):  # a deployment without AWS_* credentials cannot serve anything
        return S3CredentialsMissing(f"S3 is not usable: {exc} (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
    if isinstance(exc, RetriesExceededError):  # a transfer gave up; its last error says why
        return _translate(exc.last_exception, key) if exc.last_exception else None
    if isinstance(exc, S3UploadFailedError):  # boto3 raises it inside `except ClientError` (no `from`)
        cause = exc.__cause__ or exc.__context__
        return _translate(cause, key) if cause is not None else None
    return None


@contextmanager
def _errors_translated(key: str | None) -> Iterator[None]:
    try:
        yield
    except (ClientError, NoCredentialsError, RetriesExceededError, S3UploadFailedError, *_CONNECTIVITY_ERRORS) as exc:
        translated = _translate(exc, key)
        if translated is None:
            raise
        raise translated from exc


def _translate_errors(method: _F) -> _F:
    """Decorate an ``S3Storage`` method ``(self, key_or_prefix, ...)`` so botocore errors become ours.

    Generator methods are wrapped as generators, so errors raised while a body streams are translated too.
    """

    def key_of(args: tuple[Any, ...]) -> str | None:
        return args[1] if len(args) > 1 and isinstance(args[1], str) else None

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def generator(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with _errors_translated(key_of(args)):
                yield from method(*args, **kwargs)

        return generator  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _errors_translated(key_of(args)):
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------- the backend


class S3Storage(Storage):
    """Objects under ``prefix`` in one S3 bucket.

    Args:
        client: from :func:`make_s3_client`.
        bucket: the bucket name.
        prefix: ``""`` or a ``/``-terminated key prefix every object is stored under.
        multipart_threshold: files at least this big are uploaded in parts (in parallel).
        multipart_chunksize: the part size of a multipart upload (S3's minimum is 5 MiB).
        page_size: keys per ``list_objects_v2`` page (at most 1000).
        chunk_size: bytes per chunk that :meth:`iter_range` yields.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunksize: int = DEFAULT_MULTIPART_CHUNKSIZE,
        page_size: int = DEFAULT_PAGE_SIZE,
        chunk_size: int = DEFAULT_CHUNK,
    ) -> None:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.lstrip("/")
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize)

    @classmethod
    def from_url(cls, storage_url: str, endpoint_url: str | None = None, **options: Any) -> S3Storage:
        """The backend for ``s3://bucket/prefix`` (``ENGRAM_STORAGE_URL``)."""
        bucket, prefix = parse_s3_url(storage_url)
        return cls(make_s3_client(endpoint_url), bucket, prefix, **options)

    def __repr__(self) -> str:
        return f"S3Storage(s3://{self.bucket}/{self.prefix})"

    def _key(self, key: str) -> str:
        """The full object key of a storage key, validated like :class:`~service.storage.local.LocalStorage` validates."""
        parts = key.split("/")
        if not key or key.startswith("/") or any(part in {"", ".", ".."} for part in parts):
            raise ValueError(f"invalid storage key {key!r}")
        if any(len(part.encode()) > 255 for part in parts):
            raise ObjectNotFound(key)  # local storage cannot hold such a name; keep both backends alike
        return self.prefix + key

    @_translate_errors
    def put_file(self, key: str, source: Path) -> None:
        # upload_file switches to a multipart upload above the threshold and aborts it on failure;
        # the object appears only when the upload completes, so readers never see part of it.
        self.client.upload_file(str(source), self.bucket, self._key(key), Config=self.transfer)

    def streamed_upload(self, key: str) -> S3StreamedUpload:
        return S3StreamedUpload(self.client, self.bucket, self._key(key), key, self.transfer.multipart_chunksize)

    @_translate_errors
    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    @_translate_errors
    def get_bytes(self, key: str) -> bytes:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        try:
            return bytes(body.read())  # botocore checks the length against Content-Length
        finally:
            body.close()

    @_translate_errors
    def download(self, key: str, target: Path) -> None:
        # download_file writes to a temporary name beside the target and renames it when complete.
        self.client.download_file(self.bucket, self._key(key), str(target), Config=self.transfer)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    @_translate_errors
    def size(self, key: str) -> int:
        return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])

    @_translate_errors
    def list(self, prefix: str) -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix, PaginationConfig={"PageSize": self.page_size}
        )
        strip = len(self.prefix)
        # S3 lists in UTF-8 byte order, which is code-point order; sorting again costs little and
        # does not depend on the server getting it right.
        return sorted(item["Key"][strip:] for page in pages for item in page.get("Contents", []))

    @_translate_errors
    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))  # a missing key is not an error in S3

    @_translate_errors
    def delete_prefix(self, prefix: str) -> None:
        # One DeleteObjects request per 1000 keys instead of one request per key.
        keys = self.list(prefix)
        for first in range(0, len(keys), 1000):
            batch = [{"Key": self.prefix + k} for k in keys[first : first + 1000]]
            response = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            failed = response.get("Errors") or []
            if failed:
                raise RuntimeError(f"S3 could not delete {len(failed)} objects, e.g. {failed[0]}")

    @_translate_errors
    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        if end < start:
            return
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end}")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return  # start lies past the end: nothing to read, as with a local file
            raise
        body = response["Body"]
        try:
            yield from body.iter_chunks(self.chunk_size)
        finally:
            body.close()  # a client that stops reading early must not leave the connection half-read

    @_translate_errors
    def abort_stale_uploads(self, older_than_s: float) -> int:
        # put_file's multipart uploads are never visible as objects, but one a crashed process left
        # unfinished keeps its parts (and their cost) until it is aborted.
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=older_than_s)
        paginator = self.client.get_paginator("list_multipart_uploads")
        stale = [
            upload
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix)
            for upload in page.get("Uploads", [])
            if upload["Initiated"] < cutoff
        ]
        for upload in stale:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        return len(stale)

    @_translate_errors
    def ping(self) -> None:
        self.client.head_bucket(Bucket=self.bucket)

    def presigned_url(self, key: str, expires_s: int) -> str:
        """A URL anyone can GET the object from for ``expires_s`` seconds (signed locally, no request).

        The URL names the endpoint as this process sees it, so clients must be able to reach it too.
        """
        return str(
            self.client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_s
            )
        )


class S3StreamedUpload(StreamedUpload):
    """A multipart upload fed the bytes of a file as they are written (see :class:`StreamedUpload`).

    The writer's buffers are cut into parts of ``part_size`` on a thread of its own (one memory copy
    per byte, off the writer's thread) and each part is sent by a pool of
    :data:`STREAMED_PARTS_IN_FLIGHT` threads, so the upload runs beside the write. The multipart
    upload is created with the first part and completed by :meth:`complete`: S3 shows the object
    only then, whole. An error of a part surfaces at the writer's next :meth:`update` (or at
    :meth:`complete`), translated like every other S3 call.
    """

    def __init__(self, client: Any, bucket: str, object_key: str, key: str, part_size: int) -> None:
        self._client, self._bucket, self._object_key, self._key = client, bucket, object_key, key
        self._part_size = part_size
        self._buffer = bytearray(part_size)
        self._filled = 0
        self._told = 0
        self._upload_id: str | None = None
        self._cutter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-upload-cut")  # one: in order
        self._senders = ThreadPoolExecutor(max_workers=STREAMED_PARTS_IN_FLIGHT, thread_name_prefix="engram-upload")
        self._cuts: deque[Future[None]] = deque()
        self._parts: list[Future[dict[str, Any]]] = []

    def update(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        self._told += view.nbytes
        self._cuts.append(self._cutter.submit(self._cut, view))
        while len(self._cuts) > STREAMED_BACKLOG:
            with _errors_translated(self._key):
                self._cuts.popleft().result()

    def _cut(self, view: memoryview) -> None:
        """Copy ``view`` into the current part; send each part that fills (on the cutter's thread)."""
        while view.nbytes:
            take = min(view.nbytes, self._part_size - self._filled)
            self._buffer[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self._part_size:
                self._send(self._buffer)
                self._buffer, self._filled = bytearray(self._part_size), 0

    def _send(self, body: bytes | bytearray) -> None:
        if self._upload_id is None:
            created = self._client.create_multipart_upload(
                Bucket=self._bucket, Key=self._object_key, ChecksumAlgorithm=CHECKSUM_ALGORITHM
            )
            self._upload_id = created["UploadId"]
        # At most 2 × the senders' parts wait in memory: the oldest is waited for before another.
        while len(waiting := [part for part in self._parts if not part.done()]) >= 2 * STREAMED_PARTS_IN_FLIGHT:
            waiting[0].result()
        self._parts.append(self._senders.submit(self._send_part, len(self._parts) + 1, body, self._upload_id))

    def _send_part(self, number: int, body: bytes | bytearray, upload_id: str) -> dict[str, Any]:
        response = self._client.upload_part(
            Bucket=self._bucket,
            Key=self._object_key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            ChecksumAlgorithm=CHECKSUM_ALGORITHM,
        )
        part = {"ETag": response["ETag"], "PartNumber": number}
        checksum = f"Checksum{CHECKSUM_ALGORITHM}"
        if checksum in response:
            part[checksum] = response[checksum]
        return part

    def complete(self, size: int) -> None:
        with _errors_translated(self._key):
            while self._cuts:
                self._cuts.popleft().result()
            if self._told != size:
                raise RuntimeError(f"{self._key}: {self._told} bytes were uploaded, the file holds {size}")
            if self._upload_id is None and self._filled == 0:  # an empty file: no part to send
                self._client.put_object(Bucket=self._bucket, Key=self._object_key, Body=b"")
                self._shutdown()
                return
            if self._filled or self._upload_id is None:
                self._send(bytes(self._buffer[: self._filled]))
            parts = [part.result() for part in self._parts]
            self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=self._object_key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
            )
        self._upload_id = None  # completed: nothing left to abort
        self._shutdown()

    def abort(self) -> None:
        for cut in self._cuts:
            cut.cancel()
        for part in self._parts:
            part.cancel()
        self._shutdown()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._object_key, UploadId=upload_id)
            except Exception:  # the janitor's abort_stale_uploads drops it later
                log.warning("could not abort the upload of %s", self._key, exc_info=True)

    def _shutdown(self) -> None:
        self._cutter.shutdown(wait=True, cancel_futures=True)
        self._senders.shutdown(wait=True, cancel_futures=True)
