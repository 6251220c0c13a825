"""Tiny, random ``…ForImageClassification`` models of every image family transformers classifies with:
ViT, DeiT, BEiT, Swin, ConvNeXt, ResNet, RegNet, EfficientNet, MobileNetV1/V2 and the vision towers of
CLIP and SigLIP, each built offline from a small config and saved with ``save_pretrained`` next to a
``preprocessor_config.json`` (the Pillow ``ViTImageProcessor`` at the model's image size: what matters
here is the architecture's layers, not how its checkpoint was trained to read images).

Used by ``scripts/architecture_sweep.py`` (its image part) and its test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import ViTImageProcessor

__all__ = ["IMAGE_FAMILIES", "IMAGE_SIDE", "make_tiny_image_classifier"]

IMAGE_SIDE = 32  # the side of the square images: Swin's patch merging and the CNNs' strides need 32
_LABELS = {index: f"class_{index}" for index in range(3)}
_VIT_LIKE = {
    "image_size": IMAGE_SIDE,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}
# family -> (config class, model class, config fields)
IMAGE_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "vit": ("ViTConfig", "ViTForImageClassification", _VIT_LIKE),
    "deit": ("DeiTConfig", "DeiTForImageClassification", _VIT_LIKE),
    "beit": ("BeitConfig", "BeitForImageClassification", {**_VIT_LIKE, "use_mean_pooling": True}),
    "swin": (
        "SwinConfig",
        "SwinForImageClassification",
        {
            "image_size": IMAGE_SIDE,
            "patch_size": 4,
            "embed_dim": 16,
            "depths": [1, 1],
            "num_heads": [2, 2],
            "window_size": 4,
        },
    ),
    "convnext": (
        "ConvNextConfig",
        "ConvNextForImageClassification",
        {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2},
    ),
    "resnet": (
        "ResNetConfig",
        "ResNetForImageClassification",
        {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "layer_type": "basic"},
    ),
    "regnet": (
        "RegNetConfig",
        "RegNetForImageClassification",
        {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "groups_width": 8},
    ),
    "efficientnet": (
        "EfficientNetConfig",
        "EfficientNetForImageClassification",
        {
            "image_size": IMAGE_SIDE,
            "width_coefficient": 0.1,
            "depth_coefficient": 0.1,
            "hidden_dim": 128,  # the top conv's width: round_filters(1280) at width 0.1
            "kernel_sizes": [3, 3],
            "in_channels": [32, 16],
            "out_channels": [16, 24],
            "depthwise_padding": [],
            "strides": [1, 2],
            "num_block_repeats": [1, 1],
            "expand_ratios": [1, 6],
        },
    ),
    "mobilenet_v1": (
        "MobileNetV1Config",
        "MobileNetV1ForImageClassification",
        {"image_size": IMAGE_SIDE, "depth_multiplier": 0.25, "min_depth": 4},
    ),
    "mobilenet_v2": (
        "MobileNetV2Config",
        "MobileNetV2ForImageClassification",
        {"image_size": IMAGE_SIDE, "depth_multiplier": 0.25, "depth_divisible_by": 4, "min_depth": 4},
    ),
    "clip_vision": (
        "CLIPConfig",
        "CLIPForImageClassification",
        {
            "vision_config": {**_VIT_LIKE, "projection_dim": 16},
            "text_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64},
            "projection_dim": 16,
        },
    ),
    "siglip_vision": (
        "SiglipConfig",
        "SiglipForImageClassification",
        {
            "vision_config": _VIT_LIKE,
            "text_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64},
        },
    ),
}


def make_tiny_image_classifier(family: str, path: Path, seed: int = 0) -> Path:
    """Write a random tiny classifier of ``family`` (a key of :data:`IMAGE_FAMILIES`), three classes,
    with a ``ViTImageProcessor`` config at :data:`IMAGE_SIDE`.

    Returns:
        ``path``.
    """
    config_name, model_name, fields = IMAGE_FAMILIES[family]
    labels = {"id2label": _LABELS, "label2id": {name: index for index, name in _LABELS.items()}}
    config = getattr(transformers, config_name)(**fields, **labels)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    ViTImageProcessor(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}).save_pretrained(path)
    return path
