"""Images as an image classifier reads them (service.engine.images): the processor from the model's
folder, pixel_values batches equal to the processor's own output and to an independent
resize/rescale/normalise, and refusals of folders without a usable processor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812  (torch's own spelling)
from PIL import Image
from transformers import (
    AutoImageProcessor,
    BertConfig,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    PretrainedConfig,
    ResNetConfig,
    ResNetForImageClassification,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
)

from engram_fixtures.vision import IMAGE_SIZE, make_tiny_resnet, make_tiny_vit
from service.engine.collect import PixelBatch, collect_statistics
from service.engine.editable import editable_layers
from service.engine.image_models import check_preprocessor_config, model_kind
from service.engine.images import (
    PREPROCESSOR_CONFIG,
    ImageProcessorError,
    channels_of,
    load_image_processor,
    pixel_batches,
    pixel_values,
)
from service.engine.model_checks import validate_model_dir
from service.engine.model_files import ModelSourceError
from tests.helpers.images import digit_image, digits

SIZE = IMAGE_SIZE  # the tiny models read 16×16 images: the 8×8 digits are upsampled


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ViT of the ten digits (16×16 images, 4×4 patches) with its processor (bilinear, mean/std 0.5)."""
    return make_tiny_vit(tmp_path_factory.mktemp("vit"), num_labels=10)


@pytest.fixture(scope="module")
def resnet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_resnet(tmp_path_factory.mktemp("resnet"), num_labels=10)


def test_batches_equal_the_processors_own_output(vit_dir: Path) -> None:
    processor = load_image_processor(vit_dir)
    images = [digit_image(i, rgb=True) for i in range(7)]
    batches = list(pixel_batches(processor, iter(images), batch_size=3, channels=3))
    assert [b.shape for b in batches] == [(3, 3, SIZE, SIZE), (3, 3, SIZE, SIZE), (1, 3, SIZE, SIZE)]
    reference = ViTImageProcessor.from_pretrained(vit_dir)(images=images, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(torch.cat(batches), reference, rtol=0, atol=0)


def test_grey_images_are_read_as_rgb(vit_dir: Path) -> None:
    processor = load_image_processor(vit_dir)
    grey = pixel_values(processor, [digit_image(4)], channels=3)
    rgb = pixel_values(processor, [digit_image(4, rgb=True)], channels=3)
    torch.testing.assert_close(grey, rgb, rtol=0, atol=0)
    torch.testing.assert_close(grey[0, 0], grey[0, 2], rtol=0, atol=0)  # the grey, in every channel


def test_pixel_values_equal_an_independent_resize_and_normalise(vit_dir: Path) -> None:
    """Bilinear upsampling (torch, half-pixel centres, as Pillow's BILINEAR), /255, (x − 0.5)/0.5.
    Pillow resizes the uint8 image to uint8 (rounding, ≤ 0.5 grey level, with its fixed-point
    weights ≤ 1), so the two agree within 1 grey level: 1/255/0.5 after normalising."""
    processor = load_image_processor(vit_dir)
    assert processor.resample == Image.Resampling.BILINEAR and list(processor.image_mean) == [0.5, 0.5, 0.5]
    ours = pixel_values(processor, [digit_image(42, rgb=True)], channels=3)[0, 0].double()
    grey = torch.from_numpy(digits()[0][42].astype(np.float64))[None, None]
    resized = F.interpolate(grey, size=(SIZE, SIZE), mode="bilinear", align_corners=False)[0, 0]
    expected = (resized / 255 - 0.5) / 0.5
    error = (ours - expected).abs().max().item()
    assert error <= (1 / 255) / 0.5 + 1e-6, error
    assert error > 0 or torch.equal(ours, expected)  # computed, not copied


def test_batches_reach_the_classifier(vit_dir: Path) -> None:
    model = ViTForImageClassification.from_pretrained(vit_dir).eval()
    processor = load_image_processor(vit_dir)
    (batch,) = pixel_batches(processor, [digit_image(i, rgb=True) for i in range(5)], 5, channels_of(model.config))
    with torch.no_grad():
        logits = model(pixel_values=batch).logits
    assert logits.shape == (5, 10) and torch.isfinite(logits).all()


def test_folder_without_preprocessor_config_is_refused_by_name(vit_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((vit_dir / "config.json").read_text())
    with pytest.raises(ImageProcessorError, match=f"{bare} has no preprocessor_config.json"):
        load_image_processor(bare)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "not a valid JSON file"),
        (json.dumps({"image_processor_type": "NoSuchImageProcessor"}), "Unrecognized image processor"),
    ],
)
def test_unusable_preprocessor_config_is_refused(tmp_path: Path, content: str, reason: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["MysteryForImageClassification"]}))
    (folder / PREPROCESSOR_CONFIG).write_text(content)
    with pytest.raises(ImageProcessorError, match=f"preprocessor_config.json is not a usable image processor: .*{reason}"):
        load_image_processor(folder)


def test_processor_of_other_channels_is_refused(vit_dir: Path) -> None:
    processor = load_image_processor(vit_dir)
    with pytest.raises(ImageProcessorError, match="cannot process 1-channel images: mean must have 1 elements"):
        pixel_values(processor, [digit_image(0)], channels=1)


def test_channel_counts_without_a_mode_are_refused() -> None:
    with pytest.raises(ImageProcessorError, match="4-channel images"):
        channels_of(ViTConfig(num_channels=4))
    assert channels_of(ViTConfig(num_channels=1)) == 1


def test_resnet_processor_batches_equal_its_own_output(resnet_dir: Path) -> None:
    processor = load_image_processor(resnet_dir)
    images = [digit_image(i, rgb=True) for i in range(4)]
    (batch,) = pixel_batches(processor, images, 8, channels=3)
    reference = AutoImageProcessor.from_pretrained(resnet_dir, backend="pil")(images=images, return_tensors="pt")
    torch.testing.assert_close(batch, reference["pixel_values"], rtol=0, atol=0)
    model = ResNetForImageClassification.from_pretrained(resnet_dir).eval()
    with torch.no_grad():
        assert model(pixel_values=batch).logits.shape == (4, 10)


def test_collection_over_pixel_batches_equals_a_float64_reference(vit_dir: Path) -> None:
    """The collection hooks see every patch token of every image (q_proj of block 0: B·(1 + 16)
    rows) and one [CLS] row per image at the head, equal to the same activations summed in float64."""
    model = ViTForImageClassification.from_pretrained(vit_dir).eval()
    processor = load_image_processor(vit_dir)
    images = [digit_image(i, rgb=True) for i in range(10)]
    batches = [PixelBatch(b) for b in pixel_batches(processor, images, 4, channels=3)]
    wanted = {"vit.layers.0.attention.q_proj", "classifier"}
    layers = [spec for spec in editable_layers(model) if spec.name in wanted]
    assert {spec.name for spec in layers} == wanted
    stats = collect_statistics(model, batches, layers)

    pixels = torch.cat([b.pixel_values for b in batches])
    with torch.no_grad():
        embedded = model.vit.embeddings(pixels)
        q_input = model.vit.layers[0].layernorm_before(embedded).double().reshape(-1, 32)
        cls_rows = model.vit(pixel_values=pixels).last_hidden_state[:, 0].double()
    for name, rows in (("vit.layers.0.attention.q_proj", q_input), ("classifier", cls_rows)):
        augmented = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)  # both layers have a bias
        torch.testing.assert_close(stats.sum_for(name), augmented.T @ augmented, rtol=1e-5, atol=1e-5)
        assert stats.counts[stats.layer_group[name]] == rows.shape[0]
    assert q_input.shape[0] == 10 * (1 + (SIZE // 4) ** 2)


# ---------------------------------------------------------------- torch-free: which models read images (the API's rules)


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        (ViTConfig(architectures=["ViTForImageClassification"]), "image"),
        (ViTConfig(), "image"),  # a backbone saved without its head
        (ResNetConfig(), "image"),
        (CLIPVisionConfig(), "image"),  # a vision tower alone
        (LlamaConfig(), "text"),
        (LlavaConfig(text_config=LlamaConfig(), vision_config=CLIPVisionConfig()), "text"),  # reads text
        (BertConfig(architectures=["BertForSequenceClassification"]), "text"),
    ],
)
def test_model_kind_from_config(config: PretrainedConfig, kind: str) -> None:
    assert model_kind(config.to_dict()) == kind


def test_registration_refuses_an_image_model_without_its_processor(vit_dir: Path, tmp_path: Path) -> None:
    validate_model_dir(vit_dir)  # the fixture's folder is a usable image model
    bare = tmp_path / "bare"
    shutil.copytree(vit_dir, bare)
    (bare / PREPROCESSOR_CONFIG).unlink()
    with pytest.raises(ModelSourceError, match="an image model needs the preprocessor_config.json"):
        validate_model_dir(bare)
    (bare / PREPROCESSOR_CONFIG).write_text(json.dumps({"image_processor_type": "ViTImageProcessor", "image_mean": [0.5]}))
    with pytest.raises(ModelSourceError, match="image_mean has 1 values, the model reads 3-channel images"):
        validate_model_dir(bare)
    (bare / PREPROCESSOR_CONFIG).write_text("[1, 2]")
    with pytest.raises(ModelSourceError, match="preprocessor_config.json is not a JSON object"):
        validate_model_dir(bare)


def test_preprocessor_config_must_name_a_processor() -> None:
    with pytest.raises(ModelSourceError, match="names no image processor"):
        check_preprocessor_config({"size": 16}, {"num_channels": 3})
    with pytest.raises(ModelSourceError, match="must be a class name"):
        check_preprocessor_config({"image_processor_type": 7}, {"model_type": "vit"})
    check_preprocessor_config({"size": 16}, {"model_type": "vit"})  # transformers chooses by model_type
