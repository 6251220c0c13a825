"""The collection of an image concept on an image classifier: stored image records to ``pixel_values``.

The stored dataset holds each image as it was sent (``{"image": base64, "label"?}``,
:mod:`service.datasets.images`). :func:`service.datasets.stored.stored_images` reads it one line at
a time, decodes each image under ``ENGRAM_MAX_IMAGE_PIXELS`` again (the worker's own setting; also
what the model's resize would hold on the way, told from the header before the pixels are decoded)
and resolves its label against the model's ``id2label`` (statistics ignore labels, but a name the
model does not know is refused now, naming the record, rather than at evaluation). Here the images
are converted with the model's own image processor (:mod:`service.engine.images`) and fed in batches
to the same collection hooks text uses (:class:`~service.engine.collect.PixelBatch`: every patch
token or conv output position counts). Every image counts whole (nothing to truncate); progress
counts images.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from service.concepts.collected import Collected, Survey
from service.concepts.plan import Collection
from service.context import Context
from service.datasets.stored import count_records, stored_images
from service.engine.collect import LayerStatistics, PixelBatch, collect_statistics
from service.engine.image_resize import ResizePath
from service.engine.images import ImageProcessorError, channels_of, load_image_processor, pixel_batches
from service.engine.layers import LayerSpec
from service.errors import InvalidInput
from service.jobs.progress import ProgressReporter


def collect_images(
    ctx: Context, job_id: str, collection: Collection, model: Any, folder: Path, path: Path, layers: Sequence[LayerSpec]
) -> Collected:
    """An image concept's statistics on the classifier ``model`` (its files in ``folder``)."""
    records = count_records(path)
    progress = ProgressReporter(ctx, job_id, records)
    started = time.monotonic()
    stats = image_statistics(
        model,
        folder,
        path,
        layers,
        batch_size=ctx.settings.collect_batch_size,
        max_pixels=ctx.settings.max_image_pixels,
        first_row=collection.plan.first_row,
        on_batch=progress.advance,
        should_stop=progress.cancelled,
    )
    report = Survey(collection.spec.max_length, records=records).report()  # an image is never cut: none truncated
    return Collected(stats, report, time.monotonic() - started)


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
        InvalidInput: a record the model cannot read (see :func:`service.datasets.stored.stored_images`),
            or a folder whose image processor does not load (its registration predates the check).
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
