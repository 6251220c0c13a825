"""Where a dataset reference's bytes come from: ``file://``, ``s3://`` and ``hf://datasets/…``.

The URI shapes (:func:`file_path`, :func:`s3_key`, :func:`hf_parts`), the cheap *fingerprint* of
the content a reference names now (:func:`fingerprint_reference`: a ``stat``, an S3 ``HEAD`` or the
hub commit a revision resolves to, never the bytes), the sources a collection job reads
(:func:`open_source`, pinned to the fingerprinted content: an ``hf://`` download at the posted
commit, an S3 read at the posted version or with ``If-Match`` on the posted ETag, a ``file://``
dataset that must ``fstat`` as posted), and the hub download cache, kept within
``ENGRAM_HF_DATASETS_CACHE_BYTES`` by :func:`trim_hf_cache`. :mod:`service.datasets.refs` checks
references and turns what these sources yield into records.
"""

from __future__ import annotations

import io
import logging
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import unquote, urlparse

from service.config import S3_BUCKET_NAME, S3_BUCKET_RULE, Settings
from service.errors import Conflict, InvalidInput
from service.models.sources import file_uri_path
from service.storage.base import ObjectNotFound, StorageUnavailable

log = logging.getLogger(__name__)

HF_DATASET = re.compile(r"^hf://datasets/([A-Za-z0-9._-]+/[A-Za-z0-9._-]+)(?:@([A-Za-z0-9._-]+))?/(.+)$")
CHUNK = 1 << 20
COMMIT = re.compile(r"^[0-9a-f]{40}$")
HF_CACHE = "hf-datasets"  # under ENGRAM_CACHE_DIR
HUB_TIMEOUT_S = 10.0  # resolving a revision at submission: a slow hub must not hold the request long
FINGERPRINT = "fingerprint"  # the key of a stored reference that holds its content's fingerprint


class Fingerprint(TypedDict, total=False):
    """What identifies a reference's content, taken without reading it: compared whole (any key
    that differs is other content) and shown key by key. Stored in the reference as this JSON.

    Which keys a fingerprint has says what it is of: a ``file://`` file's ``size``, ``mtime_ns`` and
    ``inode``; an S3 object's ``etag`` and ``size`` (and ``version_id`` in a versioned bucket); a hub
    file's ``commit``; an ImageFolder's ``files`` and ``listing`` (:func:`service.datasets.images.folder_fingerprint`).
    """

    size: int
    mtime_ns: int
    inode: int
    etag: str
    version_id: str
    commit: str
    files: int
    listing: str


# ---------------------------------------------------------------- URI shapes


def file_path(uri: str, roots: list[Path], *, strict: bool = False) -> Path:
    """The path of a ``file://`` reference, checked to lie inside ``roots`` (links resolved)."""
    raw = file_uri_path(uri, "file:// dataset")
    try:
        path = Path(raw).resolve(strict=strict)  # links resolved: one must not lead out of the roots
    except FileNotFoundError:
        raise InvalidInput(f"the dataset {raw} does not exist") from None
    except (OSError, RuntimeError) as exc:
        raise InvalidInput(f"the dataset {raw} cannot be resolved: {type(exc).__name__}") from None
    if not any(path == root or root in path.parents for root in roots):
        names = ", ".join(str(r) for r in roots) or "none configured"
        raise InvalidInput(f"{path} is outside ENGRAM_DATASET_ROOTS and ENGRAM_MODEL_ROOTS ({names})")
    return path


_FILE_TYPES = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


def _not_regular(path: Path, info: os.stat_result) -> InvalidInput:
    what = _FILE_TYPES.get(stat.S_IFMT(info.st_mode), "not a regular file")
    return InvalidInput(
        f"the dataset {path} is {what}: a dataset is a regular file (reading anything else can block "
        "or never end); give the path of a JSONL or Parquet file"
    )


def check_regular_file(path: Path) -> None:
    """Refuse a dataset path that names something other than a regular file, without opening it
    (opening a FIFO blocks until a writer comes; a device may never end). A path that does not
    exist yet passes: the job says so if it still does not."""
    try:
        info = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, info)


def s3_key(uri: str) -> tuple[str, str]:
    """``(bucket, key)`` of an ``s3://`` reference whose bucket is a bucket name (S3's rule: what
    else botocore would refuse with an exception of its own, or send somewhere unexpected)."""
    parsed = urlparse(uri)
    key = unquote(parsed.path.lstrip("/"))
    if not parsed.netloc or not key or any(part in {"", ".", ".."} for part in key.split("/")):
        raise InvalidInput(f"an s3:// dataset is s3://bucket/key with no empty, '.' or '..' segment, got {uri!r}")
    if not S3_BUCKET_NAME.fullmatch(parsed.netloc):
        raise InvalidInput(f"{parsed.netloc!r} in {uri!r} is not an S3 bucket name: a bucket name is {S3_BUCKET_RULE}")
    return parsed.netloc, key


def allowed_s3_key(uri: str, settings: Settings) -> tuple[str, str]:
    """:func:`s3_key`, for a bucket ``ENGRAM_DATASET_BUCKETS`` lists and that is not the store's own.

    The service reads with its own credentials for whoever posts a reference, so only the listed
    buckets are read; the store's bucket never is, even when listed (the settings refuse that at
    start-up; a worker started with other settings refuses it here).
    """
    bucket, key = s3_key(uri)
    if bucket == settings.storage_bucket:
        raise InvalidInput(
            f"s3://{bucket} is this service's own store: datasets are never read from it; "
            "upload the records, or copy them to a bucket of ENGRAM_DATASET_BUCKETS"
        )
    allowed = settings.dataset_bucket_names
    if bucket not in allowed:
        listed = ", ".join(sorted(allowed)) if allowed else "none: s3:// datasets are off on this service"
        raise InvalidInput(
            f"the bucket {bucket!r} is not one s3:// datasets may name (ENGRAM_DATASET_BUCKETS: {listed}); "
            "upload the records, or ask the operator to list the bucket"
        )
    return bucket, key


def hf_parts(uri: str) -> tuple[str, str | None, str]:
    match = HF_DATASET.match(uri)
    if match is None:
        raise InvalidInput(f"an hf:// dataset is hf://datasets/org/name[@revision]/path, got {uri!r}")
    repo, revision, path = match.group(1), match.group(2), match.group(3)
    if any(part in {"", ".", ".."} for part in path.split("/")) or any(p in {".", ".."} for p in repo.split("/")):
        raise InvalidInput(f"an hf:// dataset path has no empty, '.' or '..' segment, got {uri!r}")
    return repo, revision, path


# ---------------------------------------------------------------- fingerprints: what content a reference names


def fingerprint_reference(reference: dict[str, Any], settings: Settings) -> Fingerprint | None:
    """What identifies the referenced content now, read without opening it.

    Returns:
        ``file://``: ``{"size", "mtime_ns", "inode"}``; ``s3://``: ``{"etag", "size"}`` plus
        ``"version_id"`` in a versioned bucket; ``hf://``: ``{"commit"}``, the commit the revision
        resolves to. ``None`` when the source cannot be looked at now (no such file or object, no
        access, a revision neither the hub nor the local cache resolves): the job reports what it
        finds, and a later post that gets a fingerprint counts as other content.

    Raises:
        StorageUnavailable: the S3 endpoint is unreachable (a 503: no one can tell what the content is).
    """
    uri = reference["uri"]
    scheme = urlparse(uri).scheme.lower()
    if scheme == "file":
        try:
            info = os.stat(file_path(uri, settings.dataset_root_paths))
        except OSError:
            return None
        return _stat_print(info) if stat.S_ISREG(info.st_mode) else None
    if scheme == "s3":
        return _s3_print(uri, settings)
    repo, revision, _ = hf_parts(uri)
    commit = hub_commit(repo, revision, settings.cache_dir / HF_CACHE)
    return {"commit": commit} if commit is not None else None


def _stat_print(info: os.stat_result) -> Fingerprint:
    # Size and mtime change with any ordinary write; the inode changes when a file is replaced by a
    # rename (an editor's save, an atomic publish) even within one mtime tick.
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "inode": info.st_ino}


def _s3_print(uri: str, settings: Settings) -> Fingerprint | None:
    from service.storage.s3 import BucketNotFound, S3CredentialsMissing, make_s3_client

    bucket, key = allowed_s3_key(uri, settings)
    try:
        return _head_print(_head(make_s3_client(settings.s3_endpoint_url), bucket, key))
    except (ObjectNotFound, BucketNotFound, S3CredentialsMissing):  # the job reads it, or says why not
        return None
    except StorageUnavailable:
        raise
    except RuntimeError:  # access denied and the other 4xx answers: the job says which
        return None


def _head(client: Any, bucket: str, key: str, **pin: str) -> dict[str, Any]:
    """An S3 ``HEAD``, its errors translated as storage translates them (404: ObjectNotFound, …)."""
    from service.storage.s3 import _errors_translated

    with _errors_translated(key):
        return dict(client.head_object(Bucket=bucket, Key=key, **pin))


def _head_print(head: dict[str, Any]) -> Fingerprint:
    found: Fingerprint = {"etag": head["ETag"], "size": int(head["ContentLength"])}
    # "null" names the version an unversioned write overwrites in place: not a version to pin.
    if head.get("VersionId") and head["VersionId"] != "null":
        found["version_id"] = head["VersionId"]
    return found


def hub_commit(repo: str, revision: str | None, cache: Path) -> str | None:
    """The commit a hub dataset's revision resolves to (``None``: the default branch).

    A 40-hex revision is a commit already (no call). Otherwise the hub's answer, and when the hub
    cannot answer (offline, unreachable, an unknown repository or revision) the commit the local
    hub cache last resolved it to, which is what an offline download reads; ``None`` when neither tells.
    """
    if revision is not None and COMMIT.fullmatch(revision):
        return revision
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(repo, revision=revision, timeout=HUB_TIMEOUT_S).sha
        if sha is not None and COMMIT.fullmatch(sha):
            return sha
    except Exception as exc:  # the hub client raises many types (offline mode, HTTP errors, timeouts)
        log.info("cannot resolve %s@%s on the hub (%s): trying the local cache", repo, revision, type(exc).__name__)
    ref = cache / f"datasets--{repo.replace('/', '--')}" / "refs" / (revision or "main")
    try:
        cached = ref.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return cached if COMMIT.fullmatch(cached) else None


def _changed(uri: str, when: str, then: Fingerprint, now: Fingerprint | None = None) -> Conflict:
    def shown(fingerprint: Fingerprint) -> str:
        return ", ".join(f"{k} {v}" for k, v in fingerprint.items())

    seen = f"{shown(then)} then" + (f"; {shown(now)} now" if now is not None else "")
    return Conflict(f"the dataset {uri} changed {when} ({seen}): post the concept again to collect its new content")


# ---------------------------------------------------------------- the worker side: sources


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
        """Raise :class:`Conflict` when what was read may not be what was opened (nothing to check
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
            raise _not_regular(path, info)
        os.set_blocking(fd, True)  # a regular file: ordinary reads from here on
        self.opened = _stat_print(info)
        if fingerprint is not None and fingerprint != self.opened:
            os.close(fd)
            raise _changed(uri, "after the concept was posted", fingerprint, self.opened)
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
        if self._fd is not None and (now := _stat_print(os.fstat(self._fd))) != self.opened:
            raise _changed(self.uri, "while it was being read", self.opened, now)

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
            opened = _head_print(_head(self.client, self.bucket, self.key, **pin))
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
            raise _changed(uri, "after the concept was posted", fingerprint, opened)
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
                    raise _changed(self.uri, "while it was being read", self.opened) from None
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
    and its content checked against ``fingerprint`` (as :func:`fingerprint_reference` took it)."""
    scheme = urlparse(uri).scheme.lower()
    if scheme == "file":
        return _LocalSource(uri, file_path(uri, settings.dataset_root_paths, strict=True), fingerprint)
    if scheme == "s3":
        return _S3Source(uri, settings, fingerprint)
    if scheme == "hf":
        return _hf_source(uri, settings, fingerprint)
    raise InvalidInput(f"unknown dataset scheme in {uri!r}")


# ---------------------------------------------------------------- the hub download cache


def trim_hf_cache(folder: Path, budget: int, keep: set[Path]) -> list[Path]:
    """Delete a hub cache's least recently used files until it holds at most ``budget`` bytes.

    The files are each repository's ``blobs/`` (and plain files in ``snapshots/``, as in a cache
    filled by hand); refs, locks and downloads in progress (``*.incomplete``) are never touched.
    "Used" is the mtime, which :func:`_hf_source` sets on every file a job reads. A snapshot link
    left dangling is removed with its blob, so the hub client downloads the file again when asked.

    Args:
        keep: files that stay whatever their age (the one the current job reads), even when they
            alone are over the budget.

    Returns:
        The deleted files, least recently used first.
    """
    folder = folder.resolve()
    keep = {p.resolve() for p in keep}
    files = _cached_files(folder)
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, path in files:
        if total <= budget:
            break
        if path in keep:
            continue
        path.unlink(missing_ok=True)
        total -= size
        removed.append(path)
    if removed:
        _drop_dangling_links(folder)
        log.info("hub dataset cache %s: %d files deleted, %d bytes kept (budget %d)", folder, len(removed), total, budget)
    return removed


def _cached_files(folder: Path) -> list[tuple[int, int, Path]]:
    """``(mtime_ns, size, path)`` of every downloaded file of a hub cache, least recently used first."""
    found = []
    for repo in folder.glob("datasets--*"):
        for path in [*repo.glob("blobs/*"), *repo.glob("snapshots/**/*")]:
            if path.name.endswith(".incomplete"):
                continue  # another process is downloading it
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue  # another process trimmed it
            if stat.S_ISREG(info.st_mode):
                found.append((info.st_mtime_ns, info.st_size, path))
    return sorted(found)


def _drop_dangling_links(folder: Path) -> None:
    for link in folder.glob("datasets--*/snapshots/**/*"):
        if link.is_symlink() and not link.exists():
            link.unlink(missing_ok=True)
