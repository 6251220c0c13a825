"""A stored dataset read back: ``datasets/<digest>.jsonl`` as a local file, its records one line at a time.

What :mod:`service.datasets.spool` writes (one record's sorted-key JSON per line, cut at ``\\n``
only: ``json.dumps`` escapes ``\\r``, and ``str.splitlines`` would also cut inside a record at a raw
U+2028, U+0085 or U+001C, which ``ensure_ascii=False`` leaves as they are) is read here for the
collection job, text and image records alike, never the whole file in memory. A record is named as
the user finds it: ``record i`` for records posted inline or uploaded, ``dataset row r`` for a
dataset reference (``first_row``: the row of its first record).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from PIL import Image

from service.datasets.images import (
    IMAGE_FIELD,
    check_record_kinds,
    decode_image,
    is_image_record,
    read_image_record,
    record_name,
)
from service.engine.image_resize import ResizePath
from service.engine.records import Record
from service.errors import InvalidInput
from service.storage.base import Storage
from service.storage.keys import dataset_key

# How every stored image record's line begins (the spool writes sorted-key JSON, and no text record
# has an "image" field): told without parsing the line.
_IMAGE_LINE = b'{"' + IMAGE_FIELD.encode() + b'":'


def local_dataset(storage: Storage, digest: str, directory: Path) -> Path:
    """A local file holding the stored dataset: storage's own file, or a download into ``directory``."""
    key = dataset_key(digest)
    local = storage.local_path(key)
    if local is not None and local.is_file():
        return local
    target = directory / "dataset.jsonl"
    storage.download(key, target)
    return target


def row_name(index: int, first_row: int | None) -> int | str:
    """Where a user finds record ``index`` (``record_name`` of it is the message's wording)."""
    return index if first_row is None else f"dataset row {first_row + index}"


def iter_records(path: Path) -> Iterator[Record]:
    """The text records of a stored dataset file, in order."""
    with path.open("rb") as handle:
        for i, line in enumerate(handle):
            yield Record.from_mapping(json.loads(line), i)


def count_records(path: Path) -> int:
    """The records of a stored dataset file (one per line)."""
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def check_text_records(path: Path, model_id: str, first_row: int | None) -> None:
    """Refuse a stored dataset holding an image record, for a text model: a dataset by reference is
    read only in the job, so its records meet the model's kind here (naming the first image record).

    Raises:
        InvalidInput: an image record (see :func:`service.datasets.images.check_record_kinds`).
    """
    with path.open("rb") as handle:
        for index, line in enumerate(handle):
            if line.startswith(_IMAGE_LINE):
                check_record_kinds({"image": record_name(row_name(index, first_row))}, model_id, "text")


def stored_images(
    path: Path, id2label: Mapping[int, str], max_pixels: int, first_row: int | None, resize: ResizePath | None = None
) -> Iterator[Image.Image]:
    """The decoded images of a stored dataset file, in order, one line at a time.

    Args:
        id2label: the model's classes (labels are checked against them, then not used).
        first_row: a dataset reference's first row (records are then named ``dataset row i``).
        resize: the model's processor resize: an image it would blow past ``max_pixels`` is refused
            before it is decoded (:func:`service.datasets.images.check_resize_cost`).

    Raises:
        InvalidInput: a text record, an image that no longer decodes under ``max_pixels``'s bound
            or a label the model does not have (naming the record).
    """
    with path.open("rb") as handle:
        for index, line in enumerate(handle):
            where = record_name(row_name(index, first_row))
            raw: Any = json.loads(line)
            if not is_image_record(raw):
                raise InvalidInput(f"{where} is a text record; an image model reads image records only")
            record = read_image_record(raw, where, id2label)
            yield decode_image(record.data, where, max_pixels, resize)
