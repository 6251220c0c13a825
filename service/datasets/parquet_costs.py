"""What a Parquet read will cost, from the file's metadata, checked before any value is read.

The footer gives each column chunk's uncompressed size and value count; the header of each chunk's
first page (a few bytes, read where Arrow starts reading the chunk) gives a dictionary's true size
and entry count, which Arrow enforces when it decompresses the page. From these
:func:`check_footer` and :func:`check_first_pages` refuse, naming the file, the row group, the column
and the setting, what must be over a bound, and :func:`batch_rows` sizes a row group's batches by
bytes. Why these checks and what they cannot see: :mod:`service.datasets.parquet`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from service.errors import InvalidInput, PayloadTooLarge

# Decoded bytes a batch holds at once (values in Arrow, then the same values as Python objects): a
# few records of the largest size ENGRAM_MAX_RECORD_BYTES allows by default, thousands of common ones.
BATCH_BYTES = 64 << 20
# Rows a batch holds at most, however small: past a few thousand, larger batches read no faster.
MAX_BATCH_ROWS = 4096
# Per row, what a column chunk's uncompressed bytes may hold besides the row's values (a length
# prefix, levels, a share of a page header with its statistics): the footer's average is compared
# with ENGRAM_MAX_RECORD_BYTES only past this, so a row within the bound is never refused by it.
ROW_OVERHEAD = 8 << 10
# A page header is a few dozen bytes (a data page's statistics may add a few KB): read this much
# first, then at most the larger amount; a header longer still is left to Arrow's own limits.
_HEADER_BYTES, _HEADER_MAX_BYTES = 1 << 10, 64 << 10
# A dictionary page this small is read and decompressed to find its longest entry, which sizes the
# batches of its chunk: pyarrow keeps a text column's dictionary near 1 MiB (its limit, checked
# every 1024 values). A larger one (large values) is bounded by its size, the loosest bound.
DICTIONARY_READ_BYTES = 8 << 20
# Dictionary entries walked per file at most (0.5 to 4 µs each in Python: at most about a second):
# past them, dictionaries' sizes bound their entries, so a file of many row groups of dictionaries
# of empty strings costs no more. A 1 MiB dictionary of short strings holds ~100,000 entries.
DICTIONARY_ENTRIES_READ = 1 << 18
# Parquet's codec names as pyarrow.decompress spells them (None: not compressed; "": not read here:
# Parquet's LZ4 is Hadoop's framing, which pyarrow.decompress does not read).
_CODECS = {
    "UNCOMPRESSED": None,
    "SNAPPY": "snappy",
    "GZIP": "gzip",
    "BROTLI": "brotli",
    "ZSTD": "zstd",
    "LZ4_RAW": "lz4_raw",
    "LZ4": "",
}
_DICTIONARY_PAGE = 2  # parquet.thrift PageType.DICTIONARY_PAGE
_LENGTH_PREFIX = 4  # a PLAIN BYTE_ARRAY value's length, before its bytes (a dictionary page's entries)


# ---------------------------------------------------------------- costs from the metadata


@dataclass(frozen=True)
class Limits:
    """The bounds a Parquet read is checked against (``ENGRAM_MAX_RECORD_BYTES``, ``ENGRAM_MAX_DATASET_BYTES``)."""

    record_bytes: int
    dataset_bytes: int


@dataclass(frozen=True)
class Chunk:
    """One column chunk read (a leaf column of one row group) and what its metadata says it costs."""

    group: int
    index: int  # its leaf column's index in the schema
    column: str  # its path in the schema ("messages.list.element.content")
    rows: int  # the row group's
    values: int  # its values, nulls and a list's elements included
    uncompressed: int  # the footer's total_uncompressed_size (every page, headers included)
    repeated: bool  # a list's element: one row holds any number of its values
    entry_bound: int | None = None  # the largest a dictionary entry can be, from its page header

    def row_cost(self) -> float:
        """What one row of this chunk decodes to, about: its share of the chunk, or where a
        dictionary is expanded, its values a row times the largest entry."""
        rows = max(self.rows, 1)
        share = self.uncompressed / rows
        if self.entry_bound is None:
            return share
        return max(share, self.values / rows * self.entry_bound)


def leaf_columns(schema: Any, wanted: list[str]) -> list[tuple[int, str, bool]]:
    """The leaf columns (index, path, repeated) under the top-level columns ``wanted``."""
    names = set(wanted)
    leaves = []
    for index in range(len(schema)):
        column = schema.column(index)
        if column.path.split(".")[0] in names:
            leaves.append((index, column.path, column.max_repetition_level > 0))
    return leaves


def check_footer(metadata: Any, wanted: list[str], groups: list[int], uri: str, limits: Limits) -> list[Chunk]:
    """The column chunks read, refused from the footer alone where a row group or a row must be too large.

    Raises:
        PayloadTooLarge: a row group whose columns read decompress past ``ENGRAM_MAX_DATASET_BYTES``,
            a flat column chunk over ``ENGRAM_MAX_RECORD_BYTES`` a row on average.
        InvalidInput: a negative size or count in the footer.
    """
    chunks = []
    leaves = leaf_columns(metadata.schema, wanted)
    for group in groups:
        row_group = metadata.row_group(group)
        found = [
            Chunk(group, i, path, row_group.num_rows, *_sizes(row_group.column(i), uri, group, path), repeated)
            for i, path, repeated in leaves
        ]
        total = sum(chunk.uncompressed for chunk in found)
        if total > limits.dataset_bytes:
            raise PayloadTooLarge(
                f"{uri}: row group {group} decompresses to {total} bytes in the columns read "
                f"({', '.join(wanted)}), more than {limits.dataset_bytes} (the limit, ENGRAM_MAX_DATASET_BYTES); "
                "nothing was read: write the file with smaller row groups, or read fewer columns"
            )
        for chunk in found:
            if not chunk.repeated and chunk.uncompressed > chunk.rows * (limits.record_bytes + ROW_OVERHEAD):
                raise PayloadTooLarge(
                    f"{uri}: row group {group}, column {chunk.column!r}: its {chunk.rows} rows decompress to "
                    f"{chunk.uncompressed} bytes, {chunk.uncompressed // max(chunk.rows, 1)} a row, so a record of it "
                    f"is more than {limits.record_bytes} bytes (the limit for one record, ENGRAM_MAX_RECORD_BYTES); "
                    "nothing was read: split such records into shorter ones"
                )
        chunks.extend(found)
    return chunks


def _sizes(column: Any, uri: str, group: int, path: str) -> tuple[int, int]:
    values, uncompressed = column.num_values, column.total_uncompressed_size
    if values < 0 or uncompressed < 0:
        raise InvalidInput(f"{uri}: row group {group}, column {path!r}: the footer states a negative size or count")
    return values, uncompressed


# ---------------------------------------------------------------- page headers (Thrift compact protocol)


@dataclass(frozen=True)
class PageHeader:
    """What a page header says of its page: its type and sizes; a dictionary page's entries and the
    header's own length (where the page's bytes begin)."""

    kind: int
    uncompressed: int
    compressed: int | None = None
    entries: int | None = None
    length: int | None = None


class _Short(Exception):
    """The header runs past the bytes read."""


class _Compact:
    """A reader of the Thrift compact protocol, enough to read a page header and skip what it does not need."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Short
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        result = shift = 0
        while True:
            byte = self.byte()
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ValueError("a varint longer than 64 bits")

    def integer(self) -> int:
        raw = self.varint()
        return (raw >> 1) ^ -(raw & 1)  # zigzag

    def advance(self, count: int) -> None:
        if self.pos + count > len(self.data):
            raise _Short
        self.pos += count

    def fields(self) -> Iterator[tuple[int, int]]:
        """A struct's fields as (id, type); the caller reads or skips each value."""
        last = 0
        while (head := self.byte()) != 0:
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.integer()
            yield last, kind

    def skip(self, kind: int, depth: int = 0) -> None:
        if depth > 32:
            raise ValueError("a page header nested deeper than 32 levels")
        if kind in (1, 2):  # a boolean in a field header carries its value there
            return
        if kind == 3:
            self.advance(1)
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.advance(8)
        elif kind == 8:
            self.advance(self.varint())
        elif kind in (9, 10):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            for _ in range(self.varint() if size == 15 else size):
                self.skip(3 if element in (1, 2) else element, depth + 1)  # a boolean element is a byte
        elif kind == 11:
            size = self.varint()
            types = self.byte() if size else 0
            for _ in range(size):
                self.skip(3 if types >> 4 in (1, 2) else types >> 4, depth + 1)
                self.skip(3 if types & 0x0F in (1, 2) else types & 0x0F, depth + 1)
        elif kind == 12:
            for _, inner in self.fields():
                self.skip(inner, depth + 1)
        else:
            raise ValueError(f"an unknown Thrift type {kind}")


def parse_page_header(data: bytes) -> PageHeader:
    """A page header's type and sizes, and a dictionary page's entries and header length
    (``parquet.thrift`` PageHeader; a data page's header is read no further than its sizes).

    Raises:
        _Short: ``data`` ends inside the header.
        ValueError: it is no page header.
    """
    reader = _Compact(data)
    sizes: dict[int, int] = {}  # type (1), uncompressed (2) and compressed (3) page size
    entries = None
    for field, wire in reader.fields():
        if field in (1, 2, 3) and wire == 5:
            sizes[field] = reader.integer()
        elif field == 7 and wire == 12:  # dictionary_page_header: num_values is its field 1
            for inner, inner_wire in reader.fields():
                if inner == 1 and inner_wire == 5:
                    entries = reader.integer()
                else:
                    reader.skip(inner_wire)
        else:
            reader.skip(wire)
        if len(sizes) == 3 and sizes[1] != _DICTIONARY_PAGE:
            return PageHeader(sizes[1], sizes[2], sizes[3])
    if len(sizes) < 3 or min(sizes.values()) < 0:
        raise ValueError("no page type or size")
    return PageHeader(sizes[1], sizes[2], sizes[3], entries, reader.pos)


def largest_entry(read_at: Callable[[int, int], bytes], column: Any, start: int, header: PageHeader) -> int | None:
    """The longest value of a small BYTE_ARRAY dictionary page, read and decompressed here (a few
    KB to :data:`DICTIONARY_READ_BYTES`); ``None`` when it is larger, in a codec read here not, or
    not the PLAIN values its header counts (then its size bounds its entries)."""
    import pyarrow as pa

    codec = _CODECS.get(column.compression, "")
    small = max(header.uncompressed, header.compressed or 0) <= DICTIONARY_READ_BYTES
    if header.length is None or header.compressed is None or header.entries is None or not small or codec == "":
        return None
    data = read_at(start + header.length, header.compressed)
    try:
        page = (
            data if codec is None else pa.decompress(data, decompressed_size=header.uncompressed, codec=codec, asbytes=True)
        )
    except (pa.ArrowException, ValueError):
        return None  # Arrow reads the same bytes and refuses them by its own rules
    longest, at = 0, 0
    for _ in range(header.entries):  # the count the caller budgets: a page of more entries is no PLAIN page of them
        if at + _LENGTH_PREFIX > len(page):
            return None
        (length,) = struct.unpack_from("<I", page, at)
        longest, at = max(longest, length), at + _LENGTH_PREFIX + length
    return longest if at == len(page) else None


def first_page(read_at: Callable[[int, int], bytes], column: Any) -> tuple[int, PageHeader] | None:
    """Where a column chunk's first page is and its header: where Arrow starts reading the chunk (the
    dictionary page's offset when the footer names one before the data); ``None`` when it cannot be read here."""
    start = column.data_page_offset
    if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    for size in (_HEADER_BYTES, _HEADER_MAX_BYTES):
        try:
            return start, parse_page_header(read_at(start, min(size, max(column.total_compressed_size, 1))))
        except _Short:
            continue
        except (ValueError, OSError):
            return None  # Arrow reads the same bytes and refuses them by its own rules
    return None


def check_first_pages(
    read_at: Callable[[int, int], bytes], metadata: Any, chunks: list[Chunk], uri: str, limits: Limits
) -> list[Chunk]:
    """The chunks with their dictionaries' entry bounds, refused where a dictionary or the footer says too much.

    Raises:
        PayloadTooLarge: a dictionary whose entries average more than ``ENGRAM_MAX_RECORD_BYTES``.
        InvalidInput: a first page larger than the footer says its whole chunk is.
    """
    checked, entries_left = [], DICTIONARY_ENTRIES_READ
    for chunk in chunks:
        column = metadata.row_group(chunk.group).column(chunk.index)
        found = first_page(read_at, column)
        where = f"{uri}: row group {chunk.group}, column {chunk.column!r}"
        if found is None:
            checked.append(chunk)
            continue
        start, header = found
        if header.uncompressed > chunk.uncompressed:
            raise InvalidInput(
                f"{where}: its first page decompresses to {header.uncompressed} bytes, more than the "
                f"{chunk.uncompressed} the file's footer says the whole column chunk holds: the metadata "
                "is inconsistent (a corrupt or hostile file); write the file again"
            )
        if header.kind != _DICTIONARY_PAGE or column.physical_type != "BYTE_ARRAY":
            checked.append(chunk)
            continue
        entries = max(header.entries or 0, 1)
        values = max(header.uncompressed - _LENGTH_PREFIX * entries, 0)
        if values / entries > limits.record_bytes:
            raise PayloadTooLarge(
                f"{where}: its dictionary holds {entries} values of {values} bytes, {values // entries} each on "
                f"average, so a record of it is more than {limits.record_bytes} bytes (the limit for one record, "
                "ENGRAM_MAX_RECORD_BYTES); nothing was read: split such records into shorter ones"
            )
        largest = None
        if header.entries is not None and header.entries <= entries_left:
            largest = largest_entry(read_at, column, start, header)
            entries_left -= header.entries
        checked.append(replace(chunk, entry_bound=values if largest is None else largest))
    return checked


def batch_rows(chunks: list[Chunk], group: int) -> int:
    """Rows a batch of ``group`` holds: those whose values the metadata says decode to about :data:`BATCH_BYTES`."""
    per_row = sum(chunk.row_cost() for chunk in chunks if chunk.group == group)
    return int(min(max(BATCH_BYTES // max(per_row, 1.0), 1), MAX_BATCH_ROWS))
