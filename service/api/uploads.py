"""Multipart concept uploads, streamed: the JSONL ``dataset`` part is checked and spooled as it arrives.

The part may be gzip-compressed (told by its first bytes, whatever its file name); it is inflated
as it arrives, and its decompressed bytes are limited by ``ENGRAM_MAX_UPLOAD_BYTES`` as a plain
part's bytes are.

``request.form()`` would first spool the whole file, and the route then read it back whole and parse
it on the event loop before it could count a single record. Here the body is read chunk by chunk:
form fields are kept (a few, each small), and the dataset's bytes go, about a megabyte at a time, to
a worker thread that cuts them into lines and hands each record to a
:class:`~service.datasets.spool.DatasetSpool`, which writes the normalised record to a scratch file and
stops the upload at the first record over ``ENGRAM_MAX_RECORDS``. At no point is more than about a
megabyte of the upload (or one longer line) in memory.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from service.datasets.images import DEFAULT_MAX_IMAGE_PIXELS
from service.datasets.spool import DatasetSpool, JsonlFeed, SpooledDataset

if TYPE_CHECKING:  # python_multipart declares its callback types for type checkers only
    from python_multipart.multipart import MultipartCallbacks
from service.errors import InvalidInput, MalformedBody, PayloadTooLarge, ProblemError

DATASET = "dataset"
MAX_FIELDS = 64
MAX_FIELD_BYTES = 64 * 1024
BATCH_BYTES = 1 << 20  # dataset bytes handed to the parsing thread at a time


@dataclass
class Upload:
    """The form fields (every value of each, in order) and the spooled dataset."""

    fields: dict[str, list[str]]
    dataset: SpooledDataset


async def read_upload(
    request: Request,
    directory: Path,
    *,
    max_records: int,
    max_bytes: int,
    max_record_bytes: int | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> Upload:
    """Read a ``multipart/form-data`` body with one JSONL part named ``dataset`` (plain or gzip).

    Args:
        directory: a scratch folder for the spooled dataset (``dataset.jsonl``).
        max_records: the most records the dataset may hold (``ENGRAM_MAX_RECORDS``).
        max_record_bytes: the most bytes one record may hold (``ENGRAM_MAX_RECORD_BYTES``).
        max_image_pixels: the most pixels of an image record (``ENGRAM_MAX_IMAGE_PIXELS``).
        max_bytes: the most bytes the dataset part may hold (``ENGRAM_MAX_UPLOAD_BYTES``), and,
            when it is gzip-compressed, the most it may inflate to.

    Raises:
        MalformedBody: not multipart, a broken body, a line that is not JSON (naming it).
        InvalidInput: no dataset part, too many or too long fields, a line that is no record.
        PayloadTooLarge: the dataset is over either limit.
    """
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise MalformedBody("a multipart/form-data body needs a boundary in its Content-Type")
    parts = _Parts(max_bytes)
    stream = request.stream()
    with DatasetSpool(
        directory / "dataset.jsonl", max_records, max_record_bytes=max_record_bytes, max_image_pixels=max_image_pixels
    ) as spool:
        # A gzip-compressed part is inflated as it comes, limited like a plain one to ENGRAM_MAX_UPLOAD_BYTES.
        feed = JsonlFeed(spool, max_bytes=max_bytes, limit_name="ENGRAM_MAX_UPLOAD_BYTES")
        try:
            parser = MultipartParser(boundary, parts.callbacks())
            async for chunk in stream:
                parser.write(chunk)
                if parts.pending_bytes >= BATCH_BYTES:
                    await anyio.to_thread.run_sync(feed.feed, parts.take())
            parser.finalize()
        except ProblemError:
            await _drain(stream)  # so that the client, still sending, reads the answer
            raise
        except FormParserError as exc:
            raise MalformedBody(f"the multipart body is malformed: {exc}") from None
        except ClientDisconnect:  # nobody reads the answer, but the log says 4xx, not an internal error
            raise MalformedBody("the client disconnected before the body ended") from None
        if not parts.ended:
            raise MalformedBody("the multipart body ends before its closing boundary")
        if not parts.datasets:
            raise InvalidInput("multipart upload needs a file part named 'dataset' (JSONL)")
        await anyio.to_thread.run_sync(feed.feed, parts.take())
        dataset = await anyio.to_thread.run_sync(feed.finish)
    return Upload(parts.fields, dataset)


async def _drain(stream: AsyncIterator[bytes]) -> None:
    """Read and drop the rest of the body (the body-size limit still applies)."""
    try:
        async for _ in stream:
            pass
    except Exception:  # a disconnect or the size limit: there is nothing left to wait for
        return


@dataclass
class _Parts:
    """python-multipart's callbacks: fields collected, dataset bytes queued for the parsing thread."""

    max_bytes: int
    fields: dict[str, list[str]] = field(default_factory=dict)
    datasets: int = 0
    ended: bool = False
    pending: list[bytes] = field(default_factory=list)
    pending_bytes: int = 0
    dataset_bytes: int = 0
    _header: bytes = b""
    _value: bytes = b""
    _disposition: bytes = b""
    _name: str = ""
    _value_buffer: bytearray = field(default_factory=bytearray)

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def take(self) -> bytes:
        """The dataset bytes received since the last call."""
        data = b"".join(self.pending)
        self.pending.clear()
        self.pending_bytes = 0
        return data

    def _part_begin(self) -> None:
        self._disposition, self._name = b"", ""
        self._value_buffer = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise MalformedBody('a multipart part has no Content-Disposition "name"')
        self._name = _text(options[b"name"], "a part name")
        if self._name == DATASET:
            self.datasets += 1
            if self.datasets > 1:
                raise InvalidInput("multipart upload takes one 'dataset' part, got more")
            return
        if sum(len(v) for v in self.fields.values()) >= MAX_FIELDS:
            raise InvalidInput(f"multipart upload has more than {MAX_FIELDS} fields")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == DATASET:
            self.dataset_bytes += end - start
            if self.dataset_bytes > self.max_bytes:
                raise PayloadTooLarge(f"the dataset exceeds {self.max_bytes} bytes (the limit, ENGRAM_MAX_UPLOAD_BYTES)")
            self.pending.append(data[start:end])
            self.pending_bytes += end - start
            return
        self._value_buffer += data[start:end]
        if len(self._value_buffer) > MAX_FIELD_BYTES:
            raise InvalidInput(f"form field {self._name!r} exceeds {MAX_FIELD_BYTES} bytes")

    def _part_end(self) -> None:
        if self._name != DATASET:
            self.fields.setdefault(self._name, []).append(_text(bytes(self._value_buffer), f"form field {self._name!r}"))

    def _end(self) -> None:
        self.ended = True


def _text(data: bytes, what: str) -> str:
    try:
        return codecs.decode(data, "utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{what} is not UTF-8 text") from None
