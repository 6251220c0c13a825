"""The collection of an image concept on an image classifier: stored image records to ``pixel_values``.

The stored dataset holds each image as it was sent (``{"image": base64, "label"?}``,
:mod:`service.datasets.images`). The job reads it one line at a time, decodes each image under
``ENGRAM_MAX_IMAGE_PIXELS`` again (the worker's own setting; also what the model's resize would
hold on the way, told from the header before the pixels are decoded), resolves its label against the
model's ``id2label`` (statistics ignore labels, but a name the model does not know is refused now, naming the
record, rather than at evaluation), converts the images with the model's own image processor
(:mod:`service.engine.images`) and feeds them in batches to the same collection hooks text uses
(:class:`~service.engine.collect.PixelBatch`: every patch token or conv output position counts).
Progress counts images.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from service.datasets.images import (
    IMAGE_FIELD,
    LABEL_FIELD,
    check_record_kinds,
    decode_base64,
    decode_image,
    is_image_record,
    record_name,
    resolve_label,
)
from service.engine.collect import LayerStatistics, PixelBatch, collect_statistics
from service.engine.image_resize import ResizePath
from service.engine.images import ImageProcessorError, channels_of, load_image_processor, pixel_batches
from service.engine.layers import LayerSpec
from service.errors import InvalidInput


def count_records(path: Path) -> int:
    """The records of a stored dataset file (one per line)."""
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


# How every stored image record's line begins (service.datasets.spool writes sort_keys JSON, and no
# text record has an "image" field): told without parsing the line.
_IMAGE_LINE = b'{"' + IMAGE_FIELD.encode() + b'":'


def check_text_records(path: Path, model_id: str, first_row: int | None) -> None:
    """Refuse a stored dataset holding an image record, for a text model: a dataset by reference is
    read only in the job, so its records meet the model's kind here (naming the first image record).

    Raises:
        InvalidInput: an image record (see :func:`service.datasets.images.check_record_kinds`).
    """
    with path.open("rb") as handle:
        for index, line in enumerate(handle):
            if line.startswith(_IMAGE_LINE):
                where = record_name(index if first_row is None else f"dataset row {first_row + index}")
                check_record_kinds({"image": where}, model_id, "text")


def stored_images(
    path: Path, id2label: dict[int, str], max_pixels: int, first_row: int | None, resize: ResizePath | None = None
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
            where = record_name(index if first_row is None else f"dataset row {first_row + index}")
            raw: Any = json.loads(line)
            if not is_image_record(raw):
                raise InvalidInput(f"{where} is a text record; an image model reads image records only")
            resolve_label(raw.get(LABEL_FIELD), id2label, where)
            yield decode_image(decode_base64(raw[IMAGE_FIELD], where), where, max_pixels, resize)


def image_statistics(
    model: Any,
    folder: Path,
    dataset: Path,
    layers: Sequence[LayerSpec],
    *,
    batch_size: int,
    max_pixels: int,
    first_row: int | None = None,
    on_batch: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> LayerStatistics:
    """Collect an image concept's statistics on an image classifier.

    Args:
        model: the loaded classifier (its ``config`` gives the channels and ``id2label``).
        folder: the model's folder (its ``preprocessor_config.json``).
        dataset: the stored dataset file.
        on_batch: called after each batch with the number of images in it.

    Raises:
        InvalidInput: a record the model cannot read (see :func:`stored_images`), or a folder whose
            image processor does not load (its registration predates the check).
    """
    try:
        processor = load_image_processor(folder)
        channels = channels_of(model.config)
    except ImageProcessorError as exc:
        raise InvalidInput(str(exc)) from None
    id2label = {int(k): str(v) for k, v in (getattr(model.config, "id2label", None) or {}).items()}
    images = stored_images(dataset, id2label, max_pixels, first_row, ResizePath.of(processor))
    batches = (PixelBatch(values) for values in pixel_batches(processor, images, batch_size, channels))
    return collect_statistics(model, batches, layers, on_batch=on_batch, should_stop=should_stop)
