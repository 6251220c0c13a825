"""The sources a collection job reads a dataset reference from: ``file://``, ``s3://`` and ``hf://datasets/…``.

:func:`open_source` opens a reference pinned to the content fingerprinted when the concept was
posted (:mod:`service.datasets.fingerprints`): an ``hf://`` download at the posted commit, an S3
read at the posted version or with ``If-Match`` on the posted ETag, a ``file://`` dataset that must
``fstat`` as posted. The URI rules are :mod:`service.datasets.uris`; the hub download cache is
:mod:`service.datasets.hf_cache`; :mod:`service.datasets.refs` checks references and turns what
these sources yield into records.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from service.config import Settings
from service.datasets.fingerprints import Fingerprint, changed_content, head_fingerprint, head_object, stat_fingerprint
from service.datasets.hf_cache import HF_CACHE, trim_hf_cache
from service.datasets.uris import allowed_s3_key, check_regular_file, file_path, hf_parts, not_regular
from service.errors import InvalidInput
from service.storage.base import ObjectNotFound, StorageUnavailable

CHUNK = 1 << 20


class Source:
    """An opened reference: its size when known, its bytes as a stream, or a seekable file."""

    def __init__(self, uri: str, size: int | None) -> None:
        self.uri, self.size = uri, size

    def chunks(self) -> Iterator[bytes]:  # pragma: no cover - every source defines it
        raise NotImplementedError

    @contextmanager
    def seekable(self) -> Iterator[Any]:  # pragma: no cover - every source defines it
        raise NotImplementedError
        yield

    def verify(self) -> None:
        """Raise :class:`~service.errors.Conflict` when what was read may not be what was opened (nothing to check
        where every read was pinned to the opened content)."""

    def close(self) -> None:
        """Release what the source holds open."""


class _LocalSource(Source):
    """A local file, read through the descriptor opened first: a rename over its path changes
    nothing read; an in-place write shows in ``fstat`` (checked when opened and after reading)."""

    def __init__(self, uri: str, path: Path, fingerprint: Fingerprint | None = None) -> None:
        # Refused unopened when it is no regular file; opened non-blocking all the same, so a FIFO
        # swapped in after that look cannot block the job (fstat then refuses it).
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
        try:
            check_regular_file(path)
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise InvalidInput(f"the dataset {uri} does not exist") from None
        except OSError as exc:
            raise InvalidInput(f"the dataset {uri} cannot be opened: {exc.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise not_regular(path, info)
        os.set_blocking(fd, True)  # a regular file: ordinary reads from here on
        self.opened = stat_fingerprint(info)
        if fingerprint is not None and fingerprint != self.opened:
            os.close(fd)
            raise changed_content(uri, "after the concept was posted", fingerprint, self.opened)
        super().__init__(uri, info.st_size)
        self._fd: int | None = fd

    def _handle(self) -> io.BufferedReader:
        if self._fd is None:
            raise ValueError(f"{self.uri} is closed")
        os.lseek(self._fd, 0, os.SEEK_SET)
        return os.fdopen(self._fd, "rb", closefd=False)  # the descriptor outlives the reads: verify() stats it

    def chunks(self) -> Iterator[bytes]:
        with self._handle() as handle:
            while chunk := handle.read(CHUNK):
                yield chunk

    @contextmanager
    def seekable(self) -> Iterator[Any]:
        with self._handle() as handle:
            yield handle

    def verify(self) -> None:
        if self._fd is not None and (now := stat_fingerprint(os.fstat(self._fd))) != self.opened:
            raise changed_content(self.uri, "while it was being read", self.opened, now)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _S3RangeFile(io.RawIOBase):
    """A read-only, seekable view of an S3 object by ranged GETs (what Parquet's footer-first reads need)."""

    def __init__(self, read: Callable[[int, int], Iterator[bytes]], size: int) -> None:
        self.read_range, self.length, self.position = read, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.length - self.position)
        if want <= 0:
            return 0
        data = b"".join(self.read_range(self.position, self.position + want - 1))
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


class _S3Source(Source):
    """An S3 object; every ranged GET is pinned to the content opened (its version, else its ETag
    with ``If-Match``), so a write to the key while the job reads it is a 409, never mixed bytes."""

    def __init__(self, uri: str, settings: Settings, fingerprint: Fingerprint | None = None) -> None:
        from service.storage.s3 import BucketNotFound, make_s3_client

        self.bucket, self.key = allowed_s3_key(uri, settings)
        self.client = make_s3_client(settings.s3_endpoint_url)
        # A version is immutable: a versioned bucket's posted version is read even if the key moved on.
        version = (fingerprint or {}).get("version_id")
        pin = {"VersionId": version} if version else {}
        try:
            opened = head_fingerprint(head_object(self.client, self.bucket, self.key, **pin))
        except BucketNotFound:
            raise InvalidInput(f"the bucket of {uri} does not exist") from None
        except ObjectNotFound:
            what = f"no version {version} of the object" if version else "no such object"
            raise InvalidInput(f"the dataset {uri} does not exist ({what})") from None
        except StorageUnavailable:
            raise  # the endpoint is down: worth a retry
        except RuntimeError as exc:  # access denied and the other 4xx answers
            raise InvalidInput(f"cannot read {uri}: {exc}") from None
        if fingerprint is not None and fingerprint != opened:
            raise changed_content(uri, "after the concept was posted", fingerprint, opened)
        self.opened, self.pin = opened, pin or {"IfMatch": opened["etag"]}
        super().__init__(uri, opened["size"])

    def _range(self, start: int, end: int) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        from service.storage.s3 import _errors_translated

        with _errors_translated(self.key):
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={start}-{end}", **self.pin)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "PreconditionFailed":
                    raise changed_content(self.uri, "while it was being read", self.opened) from None
                raise
            body = response["Body"]
            try:
                yield from body.iter_chunks(CHUNK)
            finally:
                body.close()  # a reader that stops early must not leave the connection half-read

    def chunks(self) -> Iterator[bytes]:
        if self.size:
            yield from self._range(0, self.size - 1)

    @contextmanager
    def seekable(self) -> Iterator[Any]:
        with io.BufferedReader(_S3RangeFile(self._range, self.size or 0), buffer_size=CHUNK) as handle:
            yield handle


def _hf_source(uri: str, settings: Settings, fingerprint: Fingerprint | None = None) -> Source:
    """A hub dataset file, downloaded (streamed to disk, resumable) into ``ENGRAM_CACHE_DIR/hf-datasets``
    at the commit posted (a branch may have moved since), then the cache trimmed to its budget."""
    repo, revision, path = hf_parts(uri)
    commit = (fingerprint or {}).get("commit") or revision
    folder = settings.cache_dir / HF_CACHE
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(repo, path, repo_type="dataset", revision=commit, cache_dir=str(folder))
    except Exception as exc:  # the hub client raises many types (offline, 404, gated, no such file)
        at = f" at commit {commit}" if commit != revision else ""
        raise InvalidInput(f"cannot fetch {uri}{at} from the Hugging Face hub: {type(exc).__name__}: {exc}") from None
    real = Path(local).resolve()
    try:
        os.utime(real)  # its last use: the trimming keeps the most recently used files
    except OSError:
        pass  # a read-only cache: its files age from their download
    trim_hf_cache(folder, settings.hf_datasets_cache_bytes, keep={real})
    return _LocalSource(uri, real)


def open_source(uri: str, settings: Settings, fingerprint: Fingerprint | None = None) -> Source:
    """The reference opened for reading (nothing read yet), its rules checked again on this machine
    and its content checked against ``fingerprint`` (as
    :func:`~service.datasets.fingerprints.fingerprint_reference` took it)."""
    scheme = urlparse(uri).scheme.lower()
    if scheme == "file":
        return _LocalSource(uri, file_path(uri, settings.dataset_root_paths, strict=True), fingerprint)
    if scheme == "s3":
        return _S3Source(uri, settings, fingerprint)
    if scheme == "hf":
        return _hf_source(uri, settings, fingerprint)
    raise InvalidInput(f"unknown dataset scheme in {uri!r}")
