"""service.engine.classify on engram_fixtures.vision's tiny ResNet and ViT: the logits equal the model's
own forward on all images at once, the penultimate features equal the backbone's output computed by
hand (ViT: the [CLS] token of the last hidden state; ResNet: the pooled map), and the head applied to
them gives the logits. Tolerance 1e-5 (float32 models, batched differently), 1e-12 where the same
float32 numbers are compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageClassification, ViTConfig, ViTModel

from engram_fixtures.vision import make_tiny_resnet, make_tiny_vit
from service.engine.classify import HeadNotFound, classification_head, classify
from service.engine.collect import PixelBatch
from service.engine.images import load_image_processor, pixel_batches
from tests.helpers.images import digit_image, digits

PROBES = 23  # not a multiple of the batch size: the last batch is smaller
TOL = 1e-5


@pytest.fixture(scope="module", params=["resnet", "vit"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_resnet if request.param == "resnet" else make_tiny_vit
    return make(tmp_path_factory.mktemp(request.param), num_labels=10, seed=3)


def _pixels(folder: Path) -> list[torch.Tensor]:
    processor = load_image_processor(folder)
    images = [digit_image(index, rgb=True) for index in range(PROBES)]
    return list(pixel_batches(processor, images, batch_size=5, channels=3))


def _backbone_features(model: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "vit"):
        return model.vit(pixel_values=pixel_values).last_hidden_state[:, 0, :]
    return model.resnet(pixel_values=pixel_values).pooler_output.flatten(1)


def test_logits_and_features_equal_the_models_own_forward(model_dir: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForImageClassification.from_pretrained(model_dir)
    model.train()  # classify switches to eval (BatchNorm's running statistics) and back
    batches = _pixels(model_dir)
    labels = digits()[1][:PROBES].tolist()
    result = classify(model, (PixelBatch(b) for b in batches), labels)
    assert model.training
    model.eval()
    everything = torch.cat(batches)
    with torch.inference_mode():
        logits = model(pixel_values=everything).logits.double()
        features = _backbone_features(model, everything).double()
        by_hand = classification_head(model)(result.features.float()).double()
    assert result.labels.tolist() == labels
    assert result.logits.shape == (PROBES, 10)
    assert result.features.shape == features.shape
    torch.testing.assert_close(result.logits, logits, atol=TOL, rtol=0)
    torch.testing.assert_close(result.features, features, atol=TOL, rtol=0)
    torch.testing.assert_close(by_hand, result.logits, atol=TOL, rtol=0)


def test_a_model_without_a_classifier_is_refused_by_name() -> None:
    backbone = ViTModel(ViTConfig(image_size=16, patch_size=4, hidden_size=8, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(HeadNotFound, match="ViTModel has no `classifier` module"):
        classify(backbone, [], [])


def test_labels_must_match_the_images(model_dir: Path) -> None:
    model = AutoModelForImageClassification.from_pretrained(model_dir)
    batches = _pixels(model_dir)
    with pytest.raises(ValueError, match="23 images were classified but 22 labels"):
        classify(model, (PixelBatch(b) for b in batches), list(range(22)))
