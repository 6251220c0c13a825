"""Builders of tiny, randomly initialised image classifiers: a ``ResNetForImageClassification`` and a
``ViTForImageClassification``, each saved with ``save_pretrained`` next to the
``preprocessor_config.json`` of its image processor (the Pillow one: there is no torchvision here),
so that both load offline with ``AutoModelForImageClassification`` and ``AutoImageProcessor``.

The ResNet holds the convolutions an editor must unfold (a 7×7 stride-2 stem, 3×3 convs, a 1×1
stride-2 shortcut reading the same tensor as a 3×3 conv, none with a bias) and one biased Linear
head; the ViT a biased 4×4 stride-4 patch embedding (a ``Conv2d``) and biased Linear layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    ConvNextImageProcessor,
    PreTrainedModel,
    ResNetConfig,
    ResNetForImageClassification,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
)

__all__ = ["IMAGE_SIZE", "class_labels", "make_tiny_resnet", "make_tiny_vit"]

IMAGE_SIZE = 16


def class_labels(num_labels: int) -> dict[int, str]:
    """``id2label`` of the tiny classifiers: ``class_0`` … ``class_{n-1}``."""
    return {index: f"class_{index}" for index in range(num_labels)}


def _save(model: PreTrainedModel, processor: ConvNextImageProcessor | ViTImageProcessor, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path


def make_tiny_resnet(path: Path, num_labels: int = 4, seed: int = 0, image_size: int = IMAGE_SIZE) -> Path:
    """Write a random tiny ``ResNetForImageClassification`` (two basic stages, 8 and 16 channels) with
    a ``ConvNextImageProcessor`` config (what ``microsoft/resnet-50`` ships).

    Args:
        path: Output directory (created if missing).
        num_labels: Classes of the head.
        seed: Seed of the random initialisation.
        image_size: The processor's output side (the shortest edge it resizes to).

    Returns:
        ``path``.
    """
    labels = class_labels(num_labels)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        hidden_act="relu",
        id2label=labels,  # sets num_labels (transformers' config typing has no num_labels argument)
        label2id={name: index for index, name in labels.items()},
    )
    torch.manual_seed(seed)
    model = ResNetForImageClassification(config)
    # A shortest edge under 384: resized to image_size / crop_pct, then centre-cropped to image_size².
    processor = ConvNextImageProcessor(size={"shortest_edge": image_size})
    return _save(model, processor, path)


def make_tiny_vit(path: Path, num_labels: int = 4, seed: int = 0, image_size: int = IMAGE_SIZE) -> Path:
    """Write a random tiny ``ViTForImageClassification`` (hidden 32, 2 layers, 4×4 patches) with a
    ``ViTImageProcessor`` config.

    Args:
        path: Output directory (created if missing).
        num_labels: Classes of the head.
        seed: Seed of the random initialisation.
        image_size: Side of the square images (a multiple of 4).

    Returns:
        ``path``.
    """
    labels = class_labels(num_labels)
    config = ViTConfig(
        image_size=image_size,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        id2label=labels,  # sets num_labels (transformers' config typing has no num_labels argument)
        label2id={name: index for index, name in labels.items()},
    )
    torch.manual_seed(seed)
    model = ViTForImageClassification(config)
    processor = ViTImageProcessor(size={"height": image_size, "width": image_size})
    return _save(model, processor, path)
