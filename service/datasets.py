"""Concept datasets as stored: normalised JSON lines, spooled to a local file one record at a time.

A dataset is stored once, under ``datasets/<sha256>.jsonl``: each record as
``json.dumps(record, sort_keys=True, ensure_ascii=False)`` and ``\\n``, in the order sent. The same
records give the same bytes and so the same digest, whether they came inline as JSON or as an
uploaded JSONL file. :class:`DatasetSpool` validates, counts, hashes and writes records as they come
(the record limit stops it at the first record too many), and :class:`JsonlFeed` cuts JSONL bytes of
any chunking into lines for it: an upload never exists in memory as a whole, neither as bytes nor as
Python objects. Both are synchronous: the API runs them in a worker thread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.engine.records import Record, RecordError
from service.errors import InvalidInput, MalformedBody, PayloadTooLarge

_WRITE_BUFFER = 1 << 20


def record_line(record: Record) -> bytes:
    """One record as stored: its normalised JSON and a newline."""
    return (json.dumps(record.to_json(), sort_keys=True, ensure_ascii=False) + "\n").encode()


@dataclass(frozen=True)
class SpooledDataset:
    """A dataset's stored bytes in a local file, ready to publish under ``datasets/<digest>.jsonl``."""

    path: Path
    digest: str
    num_records: int
    kinds: frozenset[str] = frozenset()  # the record kinds it holds: "text", "prompt", "messages"
    size: int = 0  # its stored bytes


class DatasetSpool:
    """Validated records appended to a local file, hashed and counted as they come.

    Args:
        path: the file to write (created; the caller's scratch directory removes it).
        max_records: the most records a dataset may have (``ENGRAM_MAX_RECORDS``).
        max_bytes: the most bytes its stored form may have (``None``: no limit of its own; an
            upload is limited by the bytes it sends).
        limit_name: the setting ``max_bytes`` comes from, for the message.
    """

    def __init__(
        self, path: Path, max_records: int, max_bytes: int | None = None, limit_name: str = "ENGRAM_MAX_DATASET_BYTES"
    ) -> None:
        self.path, self.max_records = path, max_records
        self.max_bytes, self.limit_name = max_bytes, limit_name
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

        Raises:
            PayloadTooLarge: it would be record ``max_records + 1``.
            InvalidInput: not a record (the message names it, and ``where`` when given).
        """
        if self.count >= self.max_records:
            raise PayloadTooLarge(f"the dataset has more than {self.max_records} records (the limit, ENGRAM_MAX_RECORDS)")
        try:
            record = Record.from_mapping(raw, self.count)
        except RecordError as exc:
            raise InvalidInput(f"{where}: {exc}" if where else str(exc)) from None
        line = record_line(record)
        self.size += len(line)
        if self.max_bytes is not None and self.size > self.max_bytes:
            raise PayloadTooLarge(f"the dataset's records exceed {self.max_bytes} bytes (the limit, {self.limit_name})")
        self._sha.update(line)
        self._file.write(line)
        self.count += 1
        self.kinds.add(record.kind)

    def finish(self) -> SpooledDataset:
        """Close the file; the dataset it holds (at least one record)."""
        self._file.close()
        if self.count == 0:
            raise InvalidInput("the dataset has no records")
        return SpooledDataset(self.path, self._sha.hexdigest(), self.count, frozenset(self.kinds), self.size)


def spool_records(raw_records: Iterable[Any], path: Path, max_records: int) -> SpooledDataset:
    """Records already decoded (a JSON body's ``records``) spooled to ``path``."""
    with DatasetSpool(path, max_records) as spool:
        for raw in raw_records:
            spool.add(raw)
        return spool.finish()


class JsonlFeed:
    """JSONL bytes, cut into chunks anyhow, added to a spool line by line.

    Lines are ``\\n``-terminated (a ``\\r`` before it is JSON whitespace); blank lines are skipped;
    a UTF-8 byte-order mark before the first line is allowed. Errors name the line (1-based).
    """

    def __init__(self, spool: DatasetSpool, add: Callable[[Any, str], None] | None = None) -> None:
        self.spool = spool
        self.add = add or spool.add  # what each decoded line goes to (a reference maps columns first)
        self.lines = 0
        self._partial: list[bytes] = []  # the pieces of a line not ended yet

    def feed(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end]
            if self._partial:
                piece = b"".join([*self._partial, piece])  # once per line: no quadratic copying
                self._partial.clear()
            self._line(piece)
            start = end + 1
        if start < len(chunk):
            self._partial.append(chunk[start:])

    def finish(self) -> SpooledDataset:
        """The last line (without a final newline), then the spooled dataset."""
        self.finish_lines()
        return self.spool.finish()

    def finish_lines(self) -> None:
        """The last line, when the bytes did not end with a newline."""
        if self._partial:
            last = b"".join(self._partial)
            self._partial.clear()
            self._line(last)

    def _line(self, line: bytes) -> None:
        self.lines += 1
        number = self.lines
        if number == 1:
            line = line.removeprefix(b"\xef\xbb\xbf")
        if not line.strip():
            return
        try:
            raw = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise MalformedBody(f"dataset line {number} is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise MalformedBody(f"dataset line {number} is not valid JSON: {exc.msg} (column {exc.colno})") from None
        except RecursionError:
            raise MalformedBody(f"dataset line {number} is nested too deeply") from None
        self.add(raw, f"dataset line {number}")
