"""Datasets by reference: ``s3://``, ``hf://datasets/…`` and ``file://`` JSONL (also gzip) or Parquet, streamed.

``POST /concepts`` may name a dataset instead of sending its records. The API process only checks
the reference (:func:`check_reference`: its scheme and shape, a ``file://`` path inside the allowed
roots, a row range within ``ENGRAM_MAX_RECORDS``); it never opens it. The collection job resolves it
(:func:`resolve_reference`): it streams the source, JSONL line by line (inflated first when it is
gzip-compressed: ``.jsonl.gz``) and Parquet in batches sized by bytes, its costs checked from its
metadata first (:mod:`service.datasets.parquet`), maps columns to record fields, and hands each record to the same
:class:`~service.datasets.spool.DatasetSpool` an upload uses, so the stored ``datasets/<sha256>.jsonl``
and its digest are exactly those of the same records posted inline. Nothing is published until the
whole source has been read without a problem.

Limits: ``ENGRAM_MAX_RECORDS`` (rows kept after the row range), ``ENGRAM_MAX_DATASET_BYTES`` (the
source object's size, checked before reading when the source tells it, and again on the bytes read
and on the stored records). Each is a problem naming the setting.

Content identity. A URI names a place, not content: the object behind it may be replaced. So the
API also takes a cheap *fingerprint* of what the reference names now
(:func:`~service.datasets.fingerprints.fingerprint_reference`: a ``stat``, an S3 ``HEAD`` or the hub
commit the revision resolves to, never the bytes), stored on
the concept with the reference; the same reference with another fingerprint is other content (a new
collection). The job reads exactly the fingerprinted content or fails: an ``hf://`` download is
pinned to the posted commit and an S3 read to the posted version (versioned buckets), else every
ranged GET carries ``If-Match`` with the posted ETag; a ``file://`` dataset must ``fstat`` as posted
when opened and again once read. A change is a 409 problem on the job that says to post the concept
again (re-fingerprinting silently would give the concept content that nobody posted, and two models'
jobs could read different content). The job still hashes every record it keeps: statistics are keyed
by that digest, so content that turns out unchanged (a touched file) is never collected twice.

``hf://`` files are downloaded into ``ENGRAM_CACHE_DIR/hf-datasets``, kept within
``ENGRAM_HF_DATASETS_CACHE_BYTES`` by :func:`~service.datasets.hf_cache.trim_hf_cache` after each download.

The sources themselves are :mod:`service.datasets.uris` (URI shapes),
:mod:`service.datasets.fingerprints`, :mod:`service.datasets.sources` (pinned reads) and
:mod:`service.datasets.hf_cache`; this module checks references and turns their bytes into records.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, cast
from urllib.parse import urlparse

from service.config import Settings
from service.datasets.fingerprints import FINGERPRINT, Fingerprint, fingerprint_reference
from service.datasets.images import folder_fingerprint, image_folder, list_image_folder
from service.datasets.parquet import Limits, read_parquet
from service.datasets.sources import Source, open_source
from service.datasets.spool import DatasetSpool, JsonlFeed, SpooledDataset
from service.datasets.uris import allowed_s3_key, check_regular_file, file_path, hf_parts, s3_key
from service.errors import Conflict, InvalidInput, PayloadTooLarge

# The stored reference is a job record (a collect job's payload carries it); opened here.
from service.jobs.records import StoredReference

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
# A file:// folder of class subfolders of images (service.datasets.images.list_image_folder).
IMAGEFOLDER = "imagefolder"
# Records between cancellation checks: every one, as the job's check is throttled by time
# (service.concepts.collected.CancelCheck); 10,000 records of 16 MiB are more than a whole dataset.
_CHECK_EVERY = 1


# ---------------------------------------------------------------- the API side: shape and rules


def check_reference(raw: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """A reference checked without opening it, in the form stored on the concept.

    Args:
        raw: ``{"uri", "format"?, "columns"?, "rows"?}`` as the request schema validated it.

    Returns:
        ``{"uri", "format", "columns"?, "rows"?}``: the format resolved from the extension when not
        given, absent options left out (so the same reference always has the same form).

    Raises:
        InvalidInput: an unknown scheme, a path with ``..``, a ``file://`` path outside the roots
            or that is no regular file (a FIFO, socket or device could block the job that opens
            it), an ``s3://`` bucket that is no bucket name, not in ``ENGRAM_DATASET_BUCKETS`` or
            the store's own, a format the extension does not tell.
        PayloadTooLarge: a row range longer than ``ENGRAM_MAX_RECORDS``.
    """
    uri = raw["uri"]
    if "\x00" in uri:
        raise InvalidInput("dataset.uri contains a NUL byte")
    scheme = urlparse(uri).scheme.lower()
    path: str | Path
    if scheme == "file":
        path = file_path(uri, settings.dataset_root_paths)
    elif scheme == "s3":
        path = s3_key(uri)[1]
    elif scheme == "hf":
        path = hf_parts(uri)[2]
    else:
        raise InvalidInput(
            f"dataset.uri must be s3://bucket/key, hf://datasets/org/name[@revision]/path or file:///abs/path, got {uri!r}"
        )
    fmt = (
        raw.get("format")
        or format_of(PurePosixPath(path))
        or (IMAGEFOLDER if scheme == "file" and Path(path).is_dir() else None)
    )
    if fmt == IMAGEFOLDER:
        _check_image_folder(raw, uri, scheme, Path(path))
    if fmt is None:
        raise InvalidInput(
            f"cannot tell the format of {uri} from its extension: give dataset.format (jsonl, plain or "
            "gzip-compressed, or parquet; CSV, TSV and plain text are not read)"
        )
    reference: dict[str, Any] = {"uri": uri, "format": fmt}
    columns = {k: v for k, v in (raw.get("columns") or {}).items() if v is not None}
    if columns:
        reference["columns"] = columns
    rows = _checked_rows(raw.get("rows") or {}, settings.max_records)
    if rows is not None:
        reference["rows"] = rows
    if scheme == "s3":  # last, so a malformed reference hears what is wrong with it first
        allowed_s3_key(uri, settings)
    elif scheme == "file" and fmt != IMAGEFOLDER:
        check_regular_file(Path(path))
    return reference


def _checked_rows(rows: dict[str, Any], max_records: int) -> dict[str, int] | None:
    """A row range in its stored form (``start`` always, ``stop`` when given); ``None``: every row.

    Raises:
        PayloadTooLarge: a range longer than ``max_records`` (ENGRAM_MAX_RECORDS).
    """
    start, stop = int(rows.get("start") or 0), rows.get("stop")
    if stop is not None and int(stop) - start > max_records:
        raise PayloadTooLarge(
            f"dataset.rows selects {int(stop) - start} rows, more than {max_records} (the limit, ENGRAM_MAX_RECORDS)"
        )
    if not start and stop is None:
        return None
    return {"start": start, **({"stop": int(stop)} if stop is not None else {})}


def _check_image_folder(raw: dict[str, Any], uri: str, scheme: str, path: Path) -> None:
    """An ImageFolder reference: a ``file://`` folder (its records are its images and their folders'
    names, so no column mapping; a row range counts its files in sorted order)."""
    if scheme != "file":
        raise InvalidInput(f"an ImageFolder is read from a file:// folder, not {uri}")
    if not path.is_dir():
        raise InvalidInput(f"the ImageFolder {path} is not a folder")
    if any(v is not None for v in (raw.get("columns") or {}).values()):
        raise InvalidInput(
            "dataset.columns does not apply to an ImageFolder: its records are each image and its folder's name"
        )


def format_of(path: PurePosixPath) -> str | None:
    """The format a file name's extension tells: ``FORMATS``, or ``jsonl`` for a JSONL name with
    ``.gz`` after it (the job inflates it; gzip-compressed Parquet is not read)."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        inner = FORMATS.get(PurePosixPath(path.stem).suffix.lower())
        return inner if inner == "jsonl" else None
    return FORMATS.get(suffix)


# ---------------------------------------------------------------- fingerprints: what content a reference names


def submitted_reference(raw: dict[str, Any], settings: Settings) -> StoredReference:
    """The reference as a concept stores it: checked (:func:`check_reference`) and fingerprinted
    (:func:`fingerprint_reference`, under ``"fingerprint"``). Network calls: run it off the event loop."""
    reference = check_reference(raw, settings)
    if reference["format"] == IMAGEFOLDER:  # its listing: the files' paths, sizes, mtimes and inodes
        return StoredReference.model_validate({**reference, FINGERPRINT: _folder_print(reference["uri"], settings)})
    return StoredReference.model_validate({**reference, FINGERPRINT: fingerprint_reference(reference, settings)})


def _folder_print(uri: str, settings: Settings) -> Fingerprint:
    root = file_path(uri, settings.dataset_root_paths)
    return folder_fingerprint(list_image_folder(root, settings.max_records, settings.max_dataset_bytes))


def same_reference(a: StoredReference, b: StoredReference) -> bool:
    """Whether two stored references name the same place and read it the same way (URI, format,
    columns, rows), whatever their fingerprints say about the content there."""
    return (a.uri, a.format, a.columns, a.rows) == (b.uri, b.format, b.columns, b.rows)


def content_changed(held: StoredReference, posted: StoredReference) -> bool:
    """Whether the same reference now names other content than when ``held`` was posted. A reference
    stored before fingerprints existed has none: it counts as other content (its job may have read
    any version), so posting it again collects what is there now."""
    return held.fingerprint != posted.fingerprint


# ---------------------------------------------------------------- the worker side: records


def resolve_reference(
    reference: StoredReference, settings: Settings, directory: Path, check: Callable[[], None] | None = None
) -> SpooledDataset:
    """Stream a reference's records into ``directory/dataset.jsonl``, normalised as an upload would be.

    Args:
        reference: as :func:`submitted_reference` stored it (a ``"fingerprint"`` the content must
            still match; a reference without one, stored before fingerprints, is read as it is).
        check: called every few thousand records (a job's cancellation check).

    Raises:
        InvalidInput, MalformedBody: a missing object, a missing column, a row that is no record, a
            line that is not UTF-8 or not JSON (each naming the row or line).
        Conflict: the content is not the fingerprinted one, or changed while it was read.
        PayloadTooLarge: over ``ENGRAM_MAX_RECORDS`` or ``ENGRAM_MAX_DATASET_BYTES``.
        StorageUnavailable: the S3 endpoint is unreachable (the job is retried).
    """
    check_reference(reference.model_dump(exclude={FINGERPRINT}), settings)  # the same rules again, on the worker's settings
    if reference.format == IMAGEFOLDER:
        return _resolve_image_folder(reference, settings, directory, check)
    limit = settings.max_dataset_bytes
    source = open_source(reference.uri, settings, cast(Fingerprint | None, reference.fingerprint))
    try:
        if source.size is not None and source.size > limit:
            raise PayloadTooLarge(
                f"the dataset {reference.uri} is {source.size} bytes, over {limit} (the limit, ENGRAM_MAX_DATASET_BYTES)"
            )
        start, stop = reference.start, reference.stop
        spool_file, record_limit = directory / "dataset.jsonl", settings.max_record_bytes
        with DatasetSpool(
            spool_file,
            settings.max_records,
            max_bytes=limit,
            max_record_bytes=record_limit,
            max_image_pixels=settings.max_image_pixels,
        ) as spool:
            if reference.format == "parquet":
                limits = Limits(record_bytes=record_limit, dataset_bytes=limit)
                seen = read_parquet(source, reference.columns, _Rows(None, start, stop, check), spool, limits)
            else:
                seen = _jsonl(source, reference.columns, start, stop, spool, limit, check)
            source.verify()  # before anything is published: the records are those of the content posted
            if spool.count == 0 and start > 0:  # "no records" would hide that the file has some
                raise InvalidInput(f"dataset.rows starts at row {start}, but {reference.uri} has {seen} rows")
            return spool.finish()
    finally:
        source.close()


def _resolve_image_folder(
    reference: StoredReference, settings: Settings, directory: Path, check: Callable[[], None] | None
) -> SpooledDataset:
    """An ImageFolder's records spooled as image records labelled by their folders' names, the
    folder's listing checked against the posted fingerprint before and after (as a file's ``fstat``)."""
    root = file_path(reference.uri, settings.dataset_root_paths)
    posted = reference.fingerprint
    if posted is not None and _folder_print(reference.uri, settings) != posted:
        raise Conflict(f"the dataset {reference.uri} changed since it was posted: post the concept again to collect it")
    kept = _Rows(None, reference.start, reference.stop, check)
    with DatasetSpool(
        directory / "dataset.jsonl",
        settings.max_records,
        max_bytes=settings.max_dataset_bytes,
        max_record_bytes=settings.max_record_bytes,
        max_image_pixels=settings.max_image_pixels,
    ) as spool:
        for where, record in image_folder(root, settings.max_records, settings.max_dataset_bytes):
            if kept.next_row():
                spool.add(record, where)
            if kept.done:
                break
        if posted is not None and _folder_print(reference.uri, settings) != posted:
            raise Conflict(f"the dataset {reference.uri} changed while it was read: post the concept again to collect it")
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
    source: Source,
    columns: dict[str, str] | None,
    start: int,
    stop: int | None,
    spool: DatasetSpool,
    limit: int,
    check: Callable[[], None] | None,
) -> int:
    """Spool the kept rows of a JSONL source; the number of rows read (blank lines are none)."""
    rows = _Rows(columns, start, stop, check)

    def add(raw: Any, where: str) -> None:
        keep = rows.next_row()
        if keep:
            spool.add(rows.record(raw, where), where)
        if rows.done:
            raise _Stop

    feed = JsonlFeed(spool, add=add, max_bytes=limit)  # a gzip-compressed source inflates to at most the limit
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
        pass
    return rows.row + 1
