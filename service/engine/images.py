"""Images as an image classifier reads them: the model's own image processor, in batches of ``pixel_values``.

The folder's ``preprocessor_config.json`` says how the model sees an image (resize, rescale,
normalise, crop); :func:`load_image_processor` loads it with transformers' Pillow backend, offline:
torchvision (the default backend of transformers 5's processors) is not installed here, and a
processor falls back to Pillow anyway, so asking for it says what runs. A folder without a usable
processor is an :class:`ImageProcessorError` naming the folder and the reason.

:func:`pixel_batches` converts decoded images (Pillow, any mode) to the model's channel count first
(``RGB`` for three channels, ``L`` for one: a grey scan fed to an RGB model is the grey copied to
three channels, as Pillow's ``convert`` does), then runs the processor on a batch at a time. The
batches are float32 on the CPU; the collection moves them to the model's device and dtype
(:func:`service.engine.collect.collect_statistics`, whose hooks see every row of every input).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.image_processing_base import ImageProcessingMixin

from service.engine.image_models import PREPROCESSOR_CONFIG

# Pillow's modes for a model's channel count.
_MODES = {1: "L", 3: "RGB"}


class ImageProcessorError(ValueError):
    """A model folder's image processor is missing or unusable (the message names the folder)."""


def load_image_processor(folder: Path) -> ImageProcessingMixin:
    """The image processor saved with a model, loaded offline with the Pillow backend.

    Raises:
        ImageProcessorError: no ``preprocessor_config.json``, one that is not JSON, or one that
            names no processor transformers knows (nor does the model's ``config.json``).
    """
    if not (folder / PREPROCESSOR_CONFIG).is_file():
        raise ImageProcessorError(
            f"{folder} has no {PREPROCESSOR_CONFIG}: an image model needs the image processor it was trained with "
            "(save it beside the model: processor.save_pretrained(folder))"
        )
    try:
        processor: ImageProcessingMixin = AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]  # untyped in transformers
            str(folder), backend="pil", local_files_only=True
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = str(exc).split("\n", 1)[0][:300]
        raise ImageProcessorError(f"{folder}/{PREPROCESSOR_CONFIG} is not a usable image processor: {reason}") from None
    if not callable(processor):
        raise ImageProcessorError(f"{folder}/{PREPROCESSOR_CONFIG} loads {type(processor).__name__}, no image processor")
    return processor


def channels_of(config: Any) -> int:
    """The channels the model reads (``config.num_channels``; 3 when the config does not say).

    Raises:
        ImageProcessorError: a channel count no Pillow mode has (neither 1 nor 3).
    """
    channels = int(getattr(config, "num_channels", 3) or 3)
    if channels not in _MODES:
        raise ImageProcessorError(f"the model reads {channels}-channel images; only 1 (grey) and 3 (RGB) are read")
    return channels


def to_channels(image: Image.Image, channels: int) -> Image.Image:
    """``image`` in the Pillow mode of ``channels`` (transparency dropped; grey copied to RGB)."""
    mode = _MODES[channels]
    return image if image.mode == mode else image.convert(mode)


def pixel_values(processor: ImageProcessingMixin, images: list[Image.Image], channels: int) -> torch.Tensor:
    """The processor's ``pixel_values`` of ``images`` (float32, ``[B, C, H, W]``, on the CPU).

    Raises:
        ImageProcessorError: the processor fails on ``channels``-channel images (a mean and std for
            another count), gives no ``pixel_values``, or not ``channels`` channels.
    """
    converted = [to_channels(image, channels) for image in images]
    try:
        output = processor(images=converted, return_tensors="pt")  # type: ignore[operator]
    except (ValueError, TypeError) as exc:  # its settings do not fit these images (a mean per channel)
        raise ImageProcessorError(f"{type(processor).__name__} cannot process {channels}-channel images: {exc}") from None
    values = output.get("pixel_values") if hasattr(output, "get") else None
    if not isinstance(values, torch.Tensor) or values.ndim != 4:
        raise ImageProcessorError(f"{type(processor).__name__} gave no [B, C, H, W] pixel_values")
    if values.shape[1] != channels:
        raise ImageProcessorError(
            f"{type(processor).__name__} makes {values.shape[1]}-channel pixel_values, the model reads {channels}"
        )
    return values.to(torch.float32)


def pixel_batches(
    processor: ImageProcessingMixin, images: Iterable[Image.Image], batch_size: int, channels: int
) -> Iterator[torch.Tensor]:
    """``pixel_values`` of ``images`` in order, ``batch_size`` at a time (the last batch may be smaller).

    Images are consumed as they come: at most one batch of decoded images is held at once.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    chunk: list[Image.Image] = []
    for image in images:
        chunk.append(image)
        if len(chunk) == batch_size:
            yield pixel_values(processor, chunk, channels)
            chunk = []
    if chunk:
        yield pixel_values(processor, chunk, channels)
