"""Concept datasets as stored: normalised JSON lines, spooled to a local file one record at a time.

A dataset is stored once, under ``datasets/<sha256>.jsonl``: each record as
``json.dumps(record, sort_keys=True, ensure_ascii=False)`` and ``\\n``, in the order sent. The same
records give the same bytes and so the same digest, whether they came inline as JSON or as an
uploaded JSONL file. :class:`DatasetSpool` validates, counts, hashes and writes records as they come
(the record limit stops it at the first record too many), and :class:`JsonlFeed` cuts JSONL bytes of
any chunking into lines for it, inflating them first when they are gzip-compressed (:class:`Gunzip`):
an upload never exists in memory as a whole, neither as bytes nor as Python objects. Both are
synchronous: the API runs them in a worker thread.

What is not JSON Lines is named on its first line: a JSON array, a Parquet file or another archive
is a 422 that says what to send instead, a first line that is no JSON (CSV, TSV, plain text) a 400
that says a dataset is JSON Lines. Reading them silently as something else, or answering only
"Expecting value", would leave the user guessing.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.datasets.images import DEFAULT_MAX_IMAGE_PIXELS, ImageRecord, is_image_record, record_name
from service.engine.records import Record, RecordError
from service.errors import InvalidInput, MalformedBody, PayloadTooLarge, ProblemError

_WRITE_BUFFER = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib's setting for a gzip header and trailer
INFLATE_PIECE = 1 << 20  # the most decompressed bytes made at a time (a small bomb never fills memory)
JSON_LINES = "a dataset is JSON Lines, one JSON object per line (CSV, TSV and plain text are not read)"
# Files that are not JSON Lines, told by their first bytes: (magic, what the file is, what to send instead).
_FOREIGN = (
    (re.compile(rb"PAR1"), "a Parquet file", "post it as a dataset reference (dataset.uri, format parquet)"),
    (re.compile(rb"PK\x03\x04"), "a zip archive", "send the JSON Lines file itself, plain or gzip-compressed"),
    (re.compile(rb"BZh[1-9]1AY&SY"), "a bzip2 file", "send JSON Lines plain or gzip-compressed"),
    (re.compile(rb"\xfd7zXZ\x00"), "an xz file", "send JSON Lines plain or gzip-compressed"),
    (re.compile(rb"\x28\xb5\x2f\xfd"), "a zstd file", "send JSON Lines plain or gzip-compressed"),
)


def record_line(record: Record | ImageRecord) -> bytes:
    """One record as stored: its normalised JSON and a newline."""
    return (json.dumps(record.to_json(), sort_keys=True, ensure_ascii=False) + "\n").encode()


@dataclass(frozen=True)
class SpooledDataset:
    """A dataset's stored bytes in a local file, ready to publish under ``datasets/<digest>.jsonl``."""

    path: Path
    digest: str
    num_records: int
    kinds: frozenset[str] = frozenset()  # the record kinds it holds: "text", "prompt", "messages", "image"
    size: int = 0  # its stored bytes
    # kind -> the first record of that kind, named as messages name it ("record 3", "dataset row 7")
    first: Mapping[str, str] = field(default_factory=dict)
    # each image label it holds -> the first record with it, named as ``first`` names them: the
    # submission checks them against each image model's classes (a job would fail on the first)
    labels: Mapping[int | str, str] = field(default_factory=dict)


class DatasetSpool:
    """Validated records appended to a local file, hashed and counted as they come.

    Args:
        path: the file to write (created; the caller's scratch directory removes it).
        max_records: the most records a dataset may have (``ENGRAM_MAX_RECORDS``).
        max_bytes: the most bytes its stored form may have (``None``: no limit of its own; an
            upload is limited by the bytes it sends).
        limit_name: the setting ``max_bytes`` comes from, for the message.
        max_record_bytes: the most bytes one record's stored form may have (``ENGRAM_MAX_RECORD_BYTES``;
            ``None``: no limit of its own).
        max_image_pixels: the most pixels of an image record (``ENGRAM_MAX_IMAGE_PIXELS``).
    """

    def __init__(
        self,
        path: Path,
        max_records: int,
        max_bytes: int | None = None,
        limit_name: str = "ENGRAM_MAX_DATASET_BYTES",
        *,
        max_record_bytes: int | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        self.path, self.max_records = path, max_records
        self.max_image_pixels = max_image_pixels
        self.first: dict[str, str] = {}
        self.labels: dict[int | str, str] = {}
        self.max_bytes, self.limit_name = max_bytes, limit_name
        self.max_record_bytes = max_record_bytes
        self.count = 0
        self.size = 0
        self.kinds: set[str] = set()
        self._sha = hashlib.sha256()
        self._file = path.open("wb", buffering=_WRITE_BUFFER)

    def __enter__(self) -> DatasetSpool:
        return self

    def __exit__(self, *_: object) -> None:
        self._file.close()

    def add(self, raw: Any, where: str | None = None) -> None:
        """Validate one decoded JSON value and append it as a record.

        Args:
            where: where the user finds it in what they sent (``"dataset line 7"``, ``"dataset row
                12"``); ``None``: ``records[i]`` of an inline body, named ``"record i"``. A message
                names a record one way only: a count of the records kept so far would differ from
                the line or row wherever blank lines or a row range came before it.

        Raises:
            PayloadTooLarge: it would be record ``max_records + 1``.
            InvalidInput: not a record (the message names it).
        """
        if self.count >= self.max_records:
            raise PayloadTooLarge(f"the dataset has more than {self.max_records} records (the limit, ENGRAM_MAX_RECORDS)")
        named = self.count if where is None else where
        record: Record | ImageRecord
        try:
            if is_image_record(raw):  # {"image": base64, "label"?}: checked, never decoded (service.datasets.images)
                record = ImageRecord.from_mapping(raw, named, self.max_image_pixels)
            else:
                record = Record.from_mapping(raw, named)
        except RecordError as exc:
            raise InvalidInput(str(exc)) from None
        line = record_line(record)
        if self.max_record_bytes is not None and len(line) > self.max_record_bytes:
            raise record_too_large(where or f"record {self.count}", len(line), self.max_record_bytes)
        self.size += len(line)
        if self.max_bytes is not None and self.size > self.max_bytes:
            raise PayloadTooLarge(f"the dataset's records exceed {self.max_bytes} bytes (the limit, {self.limit_name})")
        self._sha.update(line)
        self._file.write(line)
        self.first.setdefault(record.kind, record_name(named))
        if isinstance(record, ImageRecord) and record.label is not None:
            self.labels.setdefault(record.label, record_name(named))
        self.count += 1
        self.kinds.add(record.kind)

    def finish(self) -> SpooledDataset:
        """Close the file; the dataset it holds (at least one record)."""
        self._file.close()
        if self.count == 0:
            raise InvalidInput("the dataset has no records")
        kinds = frozenset(self.kinds)
        return SpooledDataset(self.path, self._sha.hexdigest(), self.count, kinds, self.size, self.first, self.labels)


def record_too_large(where: str, size: int, limit: int, *, at_least: bool = False) -> PayloadTooLarge:
    """A record over ``ENGRAM_MAX_RECORD_BYTES``: refused rather than read (a record is cut to
    max_length tokens anyway; what bounds a collection's memory is that no record is larger)."""
    return PayloadTooLarge(
        f"{where} is {'over ' if at_least else ''}{size} bytes, more than {limit} (the limit for one record, "
        "ENGRAM_MAX_RECORD_BYTES); "
        "split it into shorter records: a collection reads only its first max_length tokens"
    )


# A JSON line longer than this many times ENGRAM_MAX_RECORD_BYTES cannot hold a record within it
# (``\uXXXX`` spells a byte in 6): refused before it is parsed.
_ESCAPED_BYTES = 6


def spool_records(
    raw_records: Iterable[Any],
    path: Path,
    max_records: int,
    max_record_bytes: int | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> SpooledDataset:
    """Records already decoded (a JSON body's ``records``) spooled to ``path``."""
    with DatasetSpool(path, max_records, max_record_bytes=max_record_bytes, max_image_pixels=max_image_pixels) as spool:
        for raw in raw_records:
            spool.add(raw)
        return spool.finish()


class Gunzip:
    """gzip-compressed bytes, in chunks of any size, inflated a bounded piece at a time.

    Concatenated members (``cat a.gz b.gz``, bgzip) are read one after the other, as ``gunzip``
    reads them. Each call makes at most :data:`INFLATE_PIECE` bytes at once and the total is
    limited, so a small file that inflates to gigabytes stops at the limit without filling memory.

    Args:
        max_bytes: the most decompressed bytes (``None``: no limit).
        limit_name: the setting ``max_bytes`` comes from, for the message.
    """

    def __init__(self, max_bytes: int | None, limit_name: str) -> None:
        self.max_bytes, self.limit_name = max_bytes, limit_name
        self.size = 0
        self._inflater = zlib.decompressobj(wbits=_GZIP_WBITS)
        self._held = False  # whether zlib may hold output for input already given

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decompressed bytes of ``data``, piece by piece.

        Raises:
            MalformedBody: not gzip, or corrupt.
            PayloadTooLarge: more than ``max_bytes`` decompressed.
        """
        while data or self._held:
            if self._inflater.eof:  # a member ended: what follows is the next member
                self._inflater = zlib.decompressobj(wbits=_GZIP_WBITS)
            try:
                out = self._inflater.decompress(data, INFLATE_PIECE)
            except zlib.error as exc:
                raise MalformedBody(f"the dataset is not valid gzip ({exc})") from None
            ended = self._inflater.eof
            data = self._inflater.unused_data if ended else self._inflater.unconsumed_tail
            self._held = len(out) == INFLATE_PIECE and not ended
            self.size += len(out)
            if self.max_bytes is not None and self.size > self.max_bytes:
                raise PayloadTooLarge(
                    f"the gzip-compressed dataset exceeds {self.max_bytes} bytes decompressed (the limit, {self.limit_name})"
                )
            if out:
                yield out

    def finish(self) -> None:
        """Check that the last member ended (a file cut short has no gzip trailer)."""
        if not self._inflater.eof:
            raise MalformedBody("the gzip-compressed dataset ends before its gzip stream does (a truncated file?)")


class JsonlFeed:
    """JSONL bytes, cut into chunks anyhow, added to a spool line by line.

    Lines are ``\\n``-terminated (a ``\\r`` before it is JSON whitespace); blank lines are skipped;
    a UTF-8 byte-order mark before the first line is allowed. Bytes that open with gzip's magic
    number are inflated first (:class:`Gunzip`, limited to ``max_bytes`` decompressed). Errors name
    the line (1-based).
    """

    def __init__(
        self,
        spool: DatasetSpool,
        add: Callable[[Any, str], None] | None = None,
        *,
        max_bytes: int | None = None,
        limit_name: str = "ENGRAM_MAX_DATASET_BYTES",
    ) -> None:
        self.spool = spool
        self.add = add or spool.add  # what each decoded line goes to (a reference maps columns first)
        self.max_bytes, self.limit_name = max_bytes, limit_name
        self.lines = 0
        self.content_lines = 0  # lines that were not blank
        self._partial: list[bytes] = []  # the pieces of a line not ended yet
        self._partial_size = 0
        self._head: bytes | None = b""  # the first bytes until they tell gzip from plain (then None)
        self._gunzip: Gunzip | None = None

    def feed(self, chunk: bytes) -> None:
        if self._head is not None:
            self._head += chunk
            if len(self._head) < len(GZIP_MAGIC):
                return
            chunk, self._head = self._head, None
            if chunk.startswith(GZIP_MAGIC):
                self._gunzip = Gunzip(self.max_bytes, self.limit_name)
        if self._gunzip is None:
            self._cut(chunk)
            return
        for piece in self._gunzip.feed(chunk):
            self._cut(piece)

    def finish(self) -> SpooledDataset:
        """The last line (without a final newline), then the spooled dataset."""
        self.finish_lines()
        return self.spool.finish()

    def finish_lines(self) -> None:
        """The last line, when the bytes did not end with a newline."""
        if self._head is not None:  # fewer bytes than gzip's magic number: plain
            head, self._head = self._head, None
            self._cut(head)
        if self._gunzip is not None:
            self._gunzip.finish()
        if self._partial:
            last = b"".join(self._partial)
            self._partial.clear()
            self._line(last)

    def _cut(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end]
            if self._partial:
                piece = b"".join([*self._partial, piece])  # once per line: no quadratic copying
                self._partial.clear()
                self._partial_size = 0
            self._check_line(len(piece))
            self._line(piece)
            start = end + 1
        if start < len(chunk):
            self._partial.append(chunk[start:])
            self._partial_size += len(chunk) - start
            self._check_line(self._partial_size)

    def _check_line(self, size: int) -> None:
        """Refuse a line too long to hold a record within ENGRAM_MAX_RECORD_BYTES before it is
        buffered whole or parsed (a single-line upload would otherwise be held in memory at once)."""
        limit = self.spool.max_record_bytes
        if limit is not None and size > _ESCAPED_BYTES * limit + 4096:
            raise record_too_large(f"dataset line {self.lines + 1}", size, limit, at_least=True)

    def _line(self, line: bytes) -> None:
        self.lines += 1
        number = self.lines
        if number == 1:
            line = line.removeprefix(b"\xef\xbb\xbf")
        if not line.strip():
            return
        self.content_lines += 1
        first = self.content_lines == 1
        try:
            raw = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _unreadable(line, number, exc, first) from None
        except ValueError:  # an integer of over 4,300 digits, which Python refuses to read (CVE-2020-10735)
            raise MalformedBody(
                f"dataset line {number} holds a number of over 4300 digits; no record field takes one"
            ) from None
        except RecursionError:
            raise MalformedBody(f"dataset line {number} is nested too deeply") from None
        if first and isinstance(raw, list):
            raise _json_array()
        self.add(raw, f"dataset line {number}")


def _unreadable(line: bytes, number: int, exc: ValueError, first: bool) -> ProblemError:
    """Why a line cannot be read; for the first line with content, what the file is instead when
    that shows (a JSON array, Parquet, an archive) or that a dataset is JSON Lines."""
    if first and (foreign := _not_json_lines(line)) is not None:
        return foreign
    if isinstance(exc, UnicodeDecodeError):
        return MalformedBody(f"dataset line {number} is not UTF-8 text")
    assert isinstance(exc, json.JSONDecodeError)
    hint = f"; {JSON_LINES}" if first else ""
    return MalformedBody(f"dataset line {number} is not valid JSON: {exc.msg} (column {exc.colno}){hint}")


def _not_json_lines(line: bytes) -> InvalidInput | None:
    """The problem of a first line that is no JSON when it shows what the file is instead."""
    if line.lstrip().startswith(b"["):
        return _json_array()
    for magic, what, instead in _FOREIGN:
        if magic.match(line):
            return InvalidInput(f"the dataset is {what}, not JSON Lines: {instead}")
    return None


def _json_array() -> InvalidInput:
    return InvalidInput(
        "the dataset is a JSON array, not JSON Lines: send one JSON record per line "
        "(for example `jq -c '.[]' data.json > data.jsonl`)"
    )
