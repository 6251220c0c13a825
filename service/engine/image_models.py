"""Which models read images, and what an image model's folder must hold: torch-free rules the API
checks registrations and concepts with (the loading itself is :mod:`service.engine.images`).

A model reads images when its ``config.json`` says so: an ``…ForImageClassification`` architecture,
or, for a backbone saved without its head (``ViTModel``, a CLIP or SigLIP vision tower), an
``image_size`` or ``num_channels`` with no vocabulary (a vision-language model has a vocabulary and
reads text; its vision tower is under a sub-config). Every other model reads text.

An image model is only usable with the image processor it was trained with (how images are resized
and normalised): its ``preprocessor_config.json`` must be there, a JSON object that names a processor
(``image_processor_type``, or the model's ``model_type`` for transformers to choose one) and, where it
gives a mean and standard deviation per channel, gives as many as the model reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from service.engine.model_files import ModelSourceError

ModelKind = Literal["text", "image"]
PREPROCESSOR_CONFIG = "preprocessor_config.json"
_IMAGE_HEAD = "ForImageClassification"
_PROCESSOR_KEYS = ("image_processor_type", "feature_extractor_type")


def model_kind(config: Mapping[str, Any]) -> ModelKind:
    """``"image"`` for a model that reads images (see the module's docstring), else ``"text"``."""
    architectures = config.get("architectures") or []
    if any(isinstance(a, str) and a.endswith(_IMAGE_HEAD) for a in architectures):
        return "image"
    vision_keys = "image_size" in config or "num_channels" in config
    reads_text = "vocab_size" in config or "text_config" in config
    return "image" if vision_keys and not reads_text else "text"


def check_preprocessor_config(preprocessor: Any, config: Mapping[str, Any]) -> None:
    """Refuse an image model's processor config that cannot say how to read an image.

    Args:
        preprocessor: the parsed ``preprocessor_config.json``, or ``None`` when the folder has none.
        config: the model's ``config.json``.

    Raises:
        ModelSourceError: none, not a JSON object, no processor named (and no ``model_type`` to
            choose one by), a mean or standard deviation with another count than the model's channels.
    """
    if preprocessor is None:
        raise ModelSourceError(
            f"an image model needs the {PREPROCESSOR_CONFIG} of its image processor (how images are resized "
            "and normalised); save it beside the model: processor.save_pretrained(folder)"
        )
    if not isinstance(preprocessor, dict):
        raise ModelSourceError(f"{PREPROCESSOR_CONFIG} is not a JSON object")
    named = [preprocessor[key] for key in _PROCESSOR_KEYS if key in preprocessor]
    if any(not isinstance(name, str) or not name for name in named):
        raise ModelSourceError(f"{PREPROCESSOR_CONFIG}: {' or '.join(_PROCESSOR_KEYS)} must be a class name")
    if not named and not isinstance(config.get("model_type"), str):
        raise ModelSourceError(
            f"{PREPROCESSOR_CONFIG} names no image processor (image_processor_type) and config.json no model_type"
        )
    channels = config.get("num_channels", 3)
    for key in ("image_mean", "image_std"):
        value = preprocessor.get(key)
        if isinstance(value, list) and len(value) != channels:
            raise ModelSourceError(
                f"{PREPROCESSOR_CONFIG}: {key} has {len(value)} values, the model reads {channels}-channel images"
            )
