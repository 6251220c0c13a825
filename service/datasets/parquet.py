"""Parquet references read within a memory bound their metadata states before any value is read.

What pyarrow materialises. ``ParquetFile.iter_batches`` decodes, per batch, every value of its rows
in the columns read: a BYTE_ARRAY value is copied whole into the batch, and a dictionary-encoded
column is expanded, each row getting its own copy of the entry it points to. Underneath, each page
is decompressed whole (its header states its size and Arrow checks the output against it), and a
column chunk's compressed bytes are read ``buffer_size`` at a time. So a file of 4 KB (a dictionary
of one 100 MB zero blob, zstd-compressed, and 20 rows pointing at it: what pyarrow writes for 20
equal blobs) decodes to 2 GB in one batch of 4096 rows, and ``to_pylist`` copies that again.

So costs are checked before they are paid, each refusal naming the file, the row group, the column
and the setting:

1. The footer, before any page is read (:func:`check_footer`): a row group whose columns read
   decompress past ``ENGRAM_MAX_DATASET_BYTES``; a flat column chunk whose uncompressed bytes come
   to more than ``ENGRAM_MAX_RECORD_BYTES`` a row on average (so some row is over it).
2. The header of each column chunk's first page, a few bytes read where Arrow starts reading it
   (:func:`first_page`): a dictionary whose entries average more than ``ENGRAM_MAX_RECORD_BYTES``
   (one is over it, and every entry an honest writer stores is some row's value); a first page that
   decompresses to more than the footer says the whole chunk holds (the footer lies). A small
   dictionary (to 8 MiB, pyarrow keeps text's near 1 MiB) is read for its longest entry; a larger
   one's size bounds what one value of the chunk can expand to.
3. Batches sized by bytes (:func:`batch_rows`): as many rows as the footer and the dictionary
   headers say decode to about :data:`BATCH_BYTES`, from 1 to :data:`MAX_BATCH_ROWS`.
4. Each batch's rows measured in Arrow from lengths and offsets, copying nothing
   (:func:`row_bytes`): a row over ``ENGRAM_MAX_RECORD_BYTES`` is refused by its row number before
   Python holds it, and the others become Python values a slice of at most :data:`BATCH_BYTES` at a time.

What the checks cannot see, and what bounds it then. Nothing in Arrow reads a footer's uncompressed
sizes, so a hostile writer may state small ones: a batch is then sized as if its rows were small, up
to 4096 rows, and Arrow holds their values (never an expanded dictionary's: step 2 reads the true
dictionary size from the page header) before step 4 refuses the first row over the bound; the same
holds for one huge value hidden among small ones (the average of step 1 passes), and for one row
of a list column (a conversation's turns) pointing many times at a large dictionary entry (batches
count a chunk's values a row on average). Arrow itself
decompresses one page at a time, each under 2 GiB (it reads page sizes as 32-bit integers; pyarrow
checks a page's size only every 1024 values written, so honest pages of large values reach about
1024 of them). Past these, the job's memory limit (``ENGRAM_JOB_MEMORY_BYTES``) is the last line;
for honest metadata the refusals above fire first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from service.datasets.images import IMAGE_FIELD, image_column_value
from service.datasets.parquet_costs import BATCH_BYTES, Limits, batch_rows, check_first_pages, check_footer
from service.datasets.sources import CHUNK, Source
from service.datasets.spool import DatasetSpool, record_too_large
from service.errors import InvalidInput


class RowRange(Protocol):
    """Which rows a reference keeps (:class:`service.datasets.refs._Rows`): ``row`` is the current
    row's index, ``next_row`` advances to the next (checking cancellation) and says whether it is kept."""

    start: int
    stop: int | None
    row: int

    def next_row(self) -> bool: ...

    @property
    def done(self) -> bool: ...


# ---------------------------------------------------------------- what a batch's rows hold


def row_bytes(array: Any) -> np.ndarray:
    """Per row of an Arrow array, the bytes of its values: strings and binaries by their lengths, a
    number or boolean as 1 (the least a JSON value spells), a null as 0, lists and structs as the
    sum of their parts, a dictionary's rows by their entries. Read from lengths and offsets: no
    value is copied and no dictionary expanded. At most the bytes the row's record holds as JSON."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    count = len(array)
    if pa.types.is_dictionary(kind):
        entries = row_bytes(array.dictionary)
        indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        sizes = entries[indices] if len(entries) else np.zeros(count, np.int64)
    elif (
        pa.types.is_binary(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_large_string(kind)
    ):
        sizes = pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    elif pa.types.is_fixed_size_binary(kind):
        sizes = np.full(count, kind.byte_width, np.int64)
    elif isinstance(array, pa.ListArray | pa.LargeListArray):  # a map too: a list of key/item structs
        totals = np.concatenate(([0], np.cumsum(row_bytes(array.values))))
        offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        sizes = totals[offsets[1:]] - totals[offsets[:-1]]
    elif isinstance(array, pa.FixedSizeListArray):
        sizes = row_bytes(array.flatten()).reshape(count, kind.list_size).sum(axis=1)
    elif pa.types.is_struct(kind):
        sizes = sum((row_bytes(field) for field in array.flatten()), np.zeros(count, np.int64))
    elif pa.types.is_null(kind):
        sizes = np.zeros(count, np.int64)
    else:
        sizes = np.ones(count, np.int64)
    if array.null_count:
        sizes = np.where(array.is_null().to_numpy(zero_copy_only=False), 0, sizes)
    return np.asarray(sizes, dtype=np.int64)


# ---------------------------------------------------------------- the reader


def read_parquet(source: Source, columns: dict[str, str] | None, rows: RowRange, spool: DatasetSpool, limits: Limits) -> int:
    """Spool the kept rows of a Parquet source, checked as the module says; the number of rows read or skipped.

    Raises:
        InvalidInput: not Parquet, a missing column, a row that is no record, a string not UTF-8.
        PayloadTooLarge: a row group, column chunk, dictionary or row over the limits (each named).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    with source.seekable() as probe:  # the footer and the first page headers, read through the unbuffered file
        try:
            metadata = pq.ParquetFile(probe, pre_buffer=False).metadata
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InvalidInput(f"{source.uri} is not a readable Parquet file: {exc}") from None
        names = metadata.schema.to_arrow_schema().names
        mapping = columns or _default_columns(names, source.uri)
        missing = [c for c in mapping.values() if c not in names]
        if missing:
            raise InvalidInput(f"{source.uri} has no column {missing[0]!r} (its columns: {', '.join(names)})")
        wanted = list(dict.fromkeys(mapping.values()))
        groups, first_row = _groups(metadata, rows.start, rows.stop)
        chunks = check_footer(metadata, wanted, groups, source.uri, limits)
        chunks = check_first_pages(_reader(probe), metadata, chunks, source.uri, limits)
    rows.row = first_row - 1
    with source.seekable() as handle:
        # pre_buffer (pyarrow's default) reads every selected row group before the first batch, and
        # buffer_size 0 a whole column chunk's compressed bytes at once: here a chunk is read a MiB at a time.
        parquet = pq.ParquetFile(handle, metadata=metadata, pre_buffer=False, buffer_size=CHUNK)
        reading = _Reading(source.uri, mapping, rows, spool, limits)
        try:
            for group in groups:
                for batch in parquet.iter_batches(
                    batch_size=batch_rows(chunks, group), row_groups=[group], columns=wanted, use_threads=False
                ):
                    if reading.batch(batch, group):
                        return rows.row + 1
        except (pa.ArrowException, OSError) as exc:
            raise InvalidInput(f"{source.uri} could not be read as Parquet at row {rows.row + 1}: {exc}") from None
    return rows.row + 1


def _reader(handle: Any) -> Callable[[int, int], bytes]:
    """Reads of a few bytes at an offset, past the handle's buffer (which would fetch a whole MiB from S3)."""
    raw = getattr(handle, "raw", handle)

    def read_at(offset: int, size: int) -> bytes:
        raw.seek(offset)
        return bytes(raw.read(size) or b"")

    return read_at


def _groups(metadata: Any, start: int, stop: int | None) -> tuple[list[int], int]:
    """The row groups holding rows of the range, and the index of the first one's first row (row
    groups wholly before the range are skipped without reading them; past the end, the rows there are)."""
    first_row, at = 0, 0  # at: the index of the current group's first row
    groups: list[int] = []
    for index in range(metadata.num_row_groups):
        count = metadata.row_group(index).num_rows
        if at + count > start and (stop is None or at < stop):
            if not groups:
                first_row = at
            groups.append(index)
        at += count
    return groups, first_row if groups else at  # past the end: every row was skipped


class _Reading:
    """A batch's rows turned into records: measured first, then read into Python a slice at a time."""

    def __init__(self, uri: str, mapping: dict[str, str], rows: RowRange, spool: DatasetSpool, limits: Limits) -> None:
        self.uri, self.mapping, self.rows, self.spool, self.limits = uri, mapping, rows, spool, limits
        self.uses = Counter(mapping.values())  # a column mapped to two fields is held twice by its record

    def batch(self, batch: Any, group: int) -> bool:
        """Spool a batch's kept rows; whether the row range has ended."""
        sizes = {column: row_bytes(batch.column(column)) * uses for column, uses in self.uses.items()}
        totals = sum(sizes.values(), np.zeros(batch.num_rows, np.int64))
        at = 0
        while at < batch.num_rows:
            if self.rows.row + 1 < self.rows.start:  # before the range: counted, never read
                self.rows.next_row()
                at += 1
                continue
            if totals[at] > self.limits.record_bytes:
                largest = max(sizes, key=lambda column: int(sizes[column][at]))
                where = f"dataset row {self.rows.row + 1} ({self.uri}, row group {group}, column {largest!r})"
                raise record_too_large(where, int(totals[at]), self.limits.record_bytes, at_least=True)
            end = self._slice_end(totals, at)
            if self._spool(batch.slice(at, end - at)):
                return True
            at = end
        return False

    def _slice_end(self, totals: np.ndarray, at: int) -> int:
        """The end of the slice from ``at``: rows within :data:`BATCH_BYTES` together, none over the
        record bound (it is refused when reached), none past the range's end."""
        end, held = at + 1, int(totals[at])
        left = None if self.rows.stop is None else self.rows.stop - (self.rows.row + 1)
        while end < len(totals) and (left is None or end - at < left):
            size = int(totals[end])
            if size > self.limits.record_bytes or held + size > BATCH_BYTES:
                break
            held, end = held + size, end + 1
        return end

    def _spool(self, rows: Any) -> bool:
        wanted = list(self.uses)
        try:
            values = [rows.column(column).to_pylist() for column in wanted]
        except UnicodeDecodeError:
            bad = self.rows.row + 1 + _first_bad_utf8(rows, wanted)
            raise InvalidInput(f"dataset row {bad} of {self.uri} holds a string that is not UTF-8") from None
        for cells in zip(*values, strict=True):
            if self.rows.next_row():
                row = dict(zip(wanted, cells, strict=True))
                where = f"dataset row {self.rows.row}"
                self.spool.add({field: _cell(field, row[column], where) for field, column in self.mapping.items()}, where)
            if self.rows.done:
                return True
        return False


def _first_bad_utf8(rows: Any, wanted: list[str]) -> int:
    """The index in ``rows`` of the first row holding a string that is not UTF-8."""
    for index in range(rows.num_rows):
        try:
            for column in wanted:
                rows.column(column).slice(index, 1).to_pylist()
        except UnicodeDecodeError:
            return index
    return 0


# A Parquet file's columns read by name when no dataset.columns is given, the first shape present:
# an Alpaca export's formatted "text" column (tatsu-lab/alpaca has one) comes after its fields.
DEFAULT_SHAPES = (
    (("messages",), ()),
    (("conversations",), ()),
    (("prompt", "completion"), ()),
    (("instruction", "output"), ("input",)),
    (("text",), ()),
    (("image",), ("label",)),  # the datasets library's image classification sets (mnist, beans, …)
)


def _default_columns(names: list[str], uri: str) -> dict[str, str]:
    for required, optional in DEFAULT_SHAPES:
        if all(name in names for name in required):
            return {name: name for name in (*required, *optional) if name in names}
    raise InvalidInput(
        f"{uri} has no column messages, conversations, prompt+completion, instruction+output, text or image "
        f"(its columns: {', '.join(names)}): give dataset.columns"
    )


def _cell(field: str, value: Any, where: str) -> Any:
    """A Parquet cell as the record field it maps to: an image as base64 (from a ``datasets`` Image
    struct, bytes or a base64 string; :func:`~service.datasets.images.image_column_value`)."""
    return image_column_value(value, where) if field == IMAGE_FIELD else _plain(value)


def _plain(value: Any) -> Any:
    """A Parquet value as JSON would carry it: a list of structs (messages, ShareGPT turns, content
    parts) loses the struct fields that are null, at every depth (Arrow gives every struct every
    field of the column's type: a text part an ``image_url`` of null)."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    return value
