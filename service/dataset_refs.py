"""Datasets by reference: ``s3://``, ``hf://datasets/…`` and ``file://`` JSONL or Parquet, streamed.

``POST /concepts`` may name a dataset instead of sending its records. The API process only checks
the reference (:func:`check_reference`: its scheme and shape, a ``file://`` path inside the allowed
roots, a row range within ``ENGRAM_MAX_RECORDS``); it never opens it. The collection job resolves it
(:func:`resolve_reference`): it streams the source, JSONL line by line and Parquet by record batches
of a row group at a time, maps columns to record fields, and hands each record to the same
:class:`~service.datasets.DatasetSpool` an upload uses, so the stored ``datasets/<sha256>.jsonl``
and its digest are exactly those of the same records posted inline. Nothing is published until the
whole source has been read without a problem.

Limits: ``ENGRAM_MAX_RECORDS`` (rows kept after the row range), ``ENGRAM_MAX_DATASET_BYTES`` (the
source object's size, checked before reading when the source tells it, and again on the bytes read
and on the stored records). Each is a problem naming the setting.
"""

from __future__ import annotations

import io
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

from service.config import Settings
from service.datasets import DatasetSpool, JsonlFeed, SpooledDataset
from service.errors import InvalidInput, PayloadTooLarge
from service.sources import file_uri_path
from service.storage import ObjectNotFound, StorageUnavailable

HF_DATASET = re.compile(r"^hf://datasets/([A-Za-z0-9._-]+/[A-Za-z0-9._-]+)(?:@([A-Za-z0-9._-]+))?/(.+)$")
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
FIELDS = ("text", "prompt", "completion", "messages")
_CHUNK = 1 << 20
_BATCH_ROWS = 4096
_CHECK_EVERY = 10_000  # records between cancellation checks


# ---------------------------------------------------------------- the API side: shape and rules


def check_reference(raw: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """A reference checked without opening it, in the form stored on the concept.

    Args:
        raw: ``{"uri", "format"?, "columns"?, "rows"?}`` as the request schema validated it.

    Returns:
        ``{"uri", "format", "columns"?, "rows"?}``: the format resolved from the extension when not
        given, absent options left out (so the same reference always has the same form).

    Raises:
        InvalidInput: an unknown scheme, a path with ``..``, a ``file://`` path outside the roots,
            a format the extension does not tell.
        PayloadTooLarge: a row range longer than ``ENGRAM_MAX_RECORDS``.
    """
    uri = raw["uri"]
    if "\x00" in uri:
        raise InvalidInput("dataset.uri contains a NUL byte")
    scheme = urlparse(uri).scheme.lower()
    if scheme == "file":
        path = _file_path(uri, settings.dataset_root_paths)
    elif scheme == "s3":
        path = _s3_key(uri)[1]
    elif scheme == "hf":
        path = _hf_parts(uri)[2]
    else:
        raise InvalidInput(
            f"dataset.uri must be s3://bucket/key, hf://datasets/org/name[@revision]/path or file:///abs/path, got {uri!r}"
        )
    fmt = raw.get("format") or FORMATS.get(PurePosixPath(path).suffix.lower())
    if fmt is None:
        raise InvalidInput(f"cannot tell the format of {uri} from its extension: give dataset.format (jsonl or parquet)")
    reference: dict[str, Any] = {"uri": uri, "format": fmt}
    columns = {k: v for k, v in (raw.get("columns") or {}).items() if v is not None}
    if columns:
        reference["columns"] = columns
    rows = raw.get("rows") or {}
    start, stop = int(rows.get("start") or 0), rows.get("stop")
    if stop is not None and int(stop) - start > settings.max_records:
        raise PayloadTooLarge(
            f"dataset.rows selects {int(stop) - start} rows, more than {settings.max_records} "
            "(the limit, ENGRAM_MAX_RECORDS)"
        )
    if start or stop is not None:
        reference["rows"] = {"start": start, **({"stop": int(stop)} if stop is not None else {})}
    return reference


def _file_path(uri: str, roots: list[Path], *, strict: bool = False) -> Path:
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


def _s3_key(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    key = unquote(parsed.path.lstrip("/"))
    if not parsed.netloc or not key or any(part in {"", ".", ".."} for part in key.split("/")):
        raise InvalidInput(f"an s3:// dataset is s3://bucket/key with no empty, '.' or '..' segment, got {uri!r}")
    return parsed.netloc, key


def _hf_parts(uri: str) -> tuple[str, str | None, str]:
    match = HF_DATASET.match(uri)
    if match is None:
        raise InvalidInput(f"an hf:// dataset is hf://datasets/org/name[@revision]/path, got {uri!r}")
    repo, revision, path = match.group(1), match.group(2), match.group(3)
    if any(part in {"", ".", ".."} for part in path.split("/")) or any(p in {".", ".."} for p in repo.split("/")):
        raise InvalidInput(f"an hf:// dataset path has no empty, '.' or '..' segment, got {uri!r}")
    return repo, revision, path


# ---------------------------------------------------------------- the worker side: sources


class _Source:
    """An opened reference: its size when known, its bytes as a stream, or a seekable file."""

    def __init__(self, uri: str, size: int | None) -> None:
        self.uri, self.size = uri, size

    def chunks(self) -> Iterator[bytes]:  # pragma: no cover - every source defines it
        raise NotImplementedError

    @contextmanager
    def seekable(self) -> Iterator[Any]:  # pragma: no cover - every source defines it
        raise NotImplementedError
        yield


class _LocalSource(_Source):
    def __init__(self, uri: str, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise InvalidInput(f"the dataset {uri} does not exist") from None
        except OSError as exc:
            raise InvalidInput(f"the dataset {uri} cannot be opened: {exc.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise InvalidInput(f"the dataset {uri} is not a regular file")
        super().__init__(uri, info.st_size)
        self._fd = fd

    def chunks(self) -> Iterator[bytes]:
        with os.fdopen(self._fd, "rb", closefd=True) as handle:
            while chunk := handle.read(_CHUNK):
                yield chunk

    @contextmanager
    def seekable(self) -> Iterator[Any]:
        with os.fdopen(self._fd, "rb", closefd=True) as handle:
            yield handle


class _S3RangeFile(io.RawIOBase):
    """A read-only, seekable view of an S3 object by ranged GETs (what Parquet's footer-first reads need)."""

    def __init__(self, storage: Any, key: str, size: int) -> None:
        self.storage, self.key, self.length, self.position = storage, key, size, 0

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
        data = b"".join(self.storage.iter_range(self.key, self.position, self.position + want - 1))
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


class _S3Source(_Source):
    def __init__(self, uri: str, settings: Settings) -> None:
        from service.storage_s3 import BucketNotFound, S3Storage, make_s3_client

        bucket, self.key = _s3_key(uri)
        self.storage = S3Storage(make_s3_client(settings.s3_endpoint_url), bucket, "")
        try:
            size = self.storage.size(self.key)
        except BucketNotFound:
            raise InvalidInput(f"the bucket of {uri} does not exist") from None
        except ObjectNotFound:
            raise InvalidInput(f"the dataset {uri} does not exist (no such object)") from None
        except StorageUnavailable:
            raise  # the endpoint is down: worth a retry
        except RuntimeError as exc:  # access denied and the other 4xx answers
            raise InvalidInput(f"cannot read {uri}: {exc}") from None
        super().__init__(uri, size)

    def chunks(self) -> Iterator[bytes]:
        if self.size:
            yield from self.storage.iter_range(self.key, 0, self.size - 1)

    @contextmanager
    def seekable(self) -> Iterator[Any]:
        with io.BufferedReader(_S3RangeFile(self.storage, self.key, self.size or 0), buffer_size=_CHUNK) as handle:
            yield handle


def _hf_source(uri: str, settings: Settings) -> _Source:
    """A hub dataset file, downloaded (streamed to disk, resumable) into ``ENGRAM_CACHE_DIR/hf-datasets``."""
    repo, revision, path = _hf_parts(uri)
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(
            repo, path, repo_type="dataset", revision=revision, cache_dir=str(settings.cache_dir / "hf-datasets")
        )
    except Exception as exc:  # the hub client raises many types (offline, 404, gated, no such file)
        raise InvalidInput(f"cannot fetch {uri} from the Hugging Face hub: {type(exc).__name__}: {exc}") from None
    return _LocalSource(uri, Path(local).resolve())


def open_source(uri: str, settings: Settings) -> _Source:
    """The reference opened for reading (nothing read yet), its rules checked again on this machine."""
    scheme = urlparse(uri).scheme.lower()
    if scheme == "file":
        return _LocalSource(uri, _file_path(uri, settings.dataset_root_paths, strict=True))
    if scheme == "s3":
        return _S3Source(uri, settings)
    if scheme == "hf":
        return _hf_source(uri, settings)
    raise InvalidInput(f"unknown dataset scheme in {uri!r}")


# ---------------------------------------------------------------- the worker side: records


def resolve_reference(
    reference: dict[str, Any], settings: Settings, directory: Path, check: Callable[[], None] | None = None
) -> SpooledDataset:
    """Stream a reference's records into ``directory/dataset.jsonl``, normalised as an upload would be.

    Args:
        reference: as :func:`check_reference` stored it.
        check: called every few thousand records (a job's cancellation check).

    Raises:
        InvalidInput, MalformedBody: a missing object, a missing column, a row that is no record, a
            line that is not UTF-8 or not JSON (each naming the row or line).
        PayloadTooLarge: over ``ENGRAM_MAX_RECORDS`` or ``ENGRAM_MAX_DATASET_BYTES``.
        StorageUnavailable: the S3 endpoint is unreachable (the job is retried).
    """
    check_reference(reference, settings)  # the same rules again, on the worker's settings
    limit = settings.max_dataset_bytes
    source = open_source(reference["uri"], settings)
    if source.size is not None and source.size > limit:
        raise PayloadTooLarge(
            f"the dataset {reference['uri']} is {source.size} bytes, over {limit} (the limit, ENGRAM_MAX_DATASET_BYTES)"
        )
    rows = reference.get("rows") or {}
    start, stop = int(rows.get("start", 0)), rows.get("stop")
    with DatasetSpool(directory / "dataset.jsonl", settings.max_records, max_bytes=limit) as spool:
        if reference["format"] == "parquet":
            _parquet(source, reference.get("columns"), start, stop, spool, check)
        else:
            _jsonl(source, reference.get("columns"), start, stop, spool, limit, check)
        return spool.finish()


class _Rows:
    """Which rows a reference keeps and how each becomes a record (column mapping)."""

    def __init__(self, columns: dict[str, str] | None, start: int, stop: int | None, check: Callable[[], None] | None):
        self.columns, self.start, self.stop, self.check = columns, start, stop, check
        self.row = -1  # the current row's index

    def next_row(self) -> bool:
        """Advance to the next row: whether it is kept (``False`` before ``start``)."""
        self.row += 1
        if self.check is not None and self.row % _CHECK_EVERY == 0:
            self.check()
        return self.row >= self.start

    @property
    def done(self) -> bool:
        return self.stop is not None and self.row + 1 >= self.stop

    def record(self, raw: Any, where: str) -> Any:
        if self.columns is None:
            return raw
        if not isinstance(raw, dict):
            raise InvalidInput(f"{where} is not a JSON object")
        missing = [c for c in self.columns.values() if c not in raw]
        if missing:
            raise InvalidInput(f"{where} has no column {missing[0]!r} (dataset.columns maps {self.columns})")
        return {field: raw[column] for field, column in self.columns.items()}


class _Stop(Exception):
    """The row range ended: stop reading."""


def _jsonl(
    source: _Source,
    columns: dict[str, str] | None,
    start: int,
    stop: int | None,
    spool: DatasetSpool,
    limit: int,
    check: Callable[[], None] | None,
) -> None:
    rows = _Rows(columns, start, stop, check)

    def add(raw: Any, where: str) -> None:
        keep = rows.next_row()
        if keep:
            spool.add(rows.record(raw, where), where)
        if rows.done:
            raise _Stop

    feed = JsonlFeed(spool, add=add)
    read = 0
    try:
        for chunk in source.chunks():
            read += len(chunk)
            if read > limit:
                raise PayloadTooLarge(
                    f"the dataset {source.uri} exceeds {limit} bytes (the limit, ENGRAM_MAX_DATASET_BYTES)"
                )
            feed.feed(chunk)
        feed.finish_lines()
    except _Stop:
        return


def _parquet(
    source: _Source,
    columns: dict[str, str] | None,
    start: int,
    stop: int | None,
    spool: DatasetSpool,
    check: Callable[[], None] | None,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with source.seekable() as handle:
        try:
            parquet = pq.ParquetFile(handle)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InvalidInput(f"{source.uri} is not a readable Parquet file: {exc}") from None
        names = parquet.schema_arrow.names
        mapping = columns or _default_columns(names, source.uri)
        missing = [c for c in mapping.values() if c not in names]
        if missing:
            raise InvalidInput(f"{source.uri} has no column {missing[0]!r} (its columns: {', '.join(names)})")
        # Row groups wholly before the range are skipped without reading them.
        first_row, groups = 0, []
        for index in range(parquet.num_row_groups):
            count = parquet.metadata.row_group(index).num_rows
            if first_row + count > start and (stop is None or first_row < stop):
                groups.append(index)
            elif not groups:
                first_row += count
        rows = _Rows(None, start, stop, check)
        rows.row = first_row - 1
        wanted = list(dict.fromkeys(mapping.values()))
        try:
            for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, columns=wanted, use_threads=False):
                for values in zip(*(batch.column(c).to_pylist() for c in wanted), strict=True):
                    keep = rows.next_row()
                    if keep:
                        row = dict(zip(wanted, values, strict=True))
                        where = f"dataset row {rows.row}"
                        spool.add({field: _plain(row[column]) for field, column in mapping.items()}, where)
                    if rows.done:
                        return
        except UnicodeDecodeError:
            raise InvalidInput(f"dataset row {rows.row + 1} of {source.uri} holds a string that is not UTF-8") from None
        except (pa.ArrowException, OSError) as exc:
            raise InvalidInput(f"{source.uri} could not be read as Parquet at row {rows.row + 1}: {exc}") from None


def _default_columns(names: list[str], uri: str) -> dict[str, str]:
    if "messages" in names:
        return {"messages": "messages"}
    if "prompt" in names and "completion" in names:
        return {"prompt": "prompt", "completion": "completion"}
    if "text" in names:
        return {"text": "text"}
    raise InvalidInput(
        f"{uri} has no column messages, prompt+completion or text (its columns: {', '.join(names)}): give dataset.columns"
    )


def _plain(value: Any) -> Any:
    """A Parquet value as JSON would carry it: a messages list of structs loses the struct fields that
    are null (Arrow gives every struct every field of the column's type)."""
    if isinstance(value, list):
        return [{k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item for item in value]
    return value
