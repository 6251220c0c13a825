"""The mini-CIFAR (engram_fixtures.mini_cifar): deterministic images, and tiny classifiers that learn it.

The set is built once per cache (``$ENGRAM_FIXTURE_CACHE``, default ``~/.cache/engram-fixtures``;
minutes on one thread, then found by content). The accuracies are recomputed here through
service.engine.classify and service.evaluation.classifier_metrics, not read from the build's report.
Thresholds sit below what the build measured (see ACCURACY_FLOOR) so that a change of library
version does not flip them, and far above chance (0.1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageClassification

from engram_fixtures.mini_cifar import FORGET_CLASS, MiniCifar, build_mini_cifar, load_split, make_images
from service.engine.classify import classify
from service.engine.collect import PixelBatch
from service.engine.images import load_image_processor, pixel_batches
from service.evaluation.classifier_metrics import confusion_row, top1_accuracy

# Measured 2026-11-26 on the default plan (16x16, 60 epochs, seed 0; `python -m engram_fixtures.mini_cifar`):
# test accuracy ResNet 0.936, ViT 0.894; the retrained pair on the other classes' test images 0.93 and 0.88.
# The floors are a few points under.
ACCURACY_FLOOR = {"resnet": 0.90, "vit": 0.85}


def test_images_are_deterministic_and_colour_is_not_the_class() -> None:
    first, labels = make_images(size=16, seed=0)
    second, _ = make_images(size=16, seed=0)
    assert len(first) == 1797
    assert first[5].size == (16, 16)
    assert first[5].mode == "RGB"
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first[:50], second[:50], strict=True))
    # the mean colour of an image says (almost) nothing of its class: the nearest class-mean colour is
    # right about as often as chance (0.1), far from what the shapes give (ACCURACY_FLOOR)
    means = np.array([np.asarray(image, dtype=np.float64).mean(axis=(0, 1)) for image in first])
    per_class = np.array([means[labels == c].mean(axis=0) for c in range(10)])
    nearest = ((means[:, None, :] - per_class[None, :, :]) ** 2).sum(axis=2).argmin(axis=1)
    assert float(np.mean(nearest == labels)) < 0.2


@pytest.fixture(scope="module")
def mini_cifar() -> MiniCifar:
    return build_mini_cifar()


def _classified(built: MiniCifar, architecture: str, retrained: bool) -> tuple[np.ndarray, np.ndarray]:
    folder = built.model(architecture, retrained)
    images, labels = load_split(built.test)
    model = AutoModelForImageClassification.from_pretrained(folder)
    torch.set_num_threads(1)
    batches = (PixelBatch(v) for v in pixel_batches(load_image_processor(folder), images, 64, 3))
    result = classify(model, batches, labels)
    return result.logits.numpy(), result.labels.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["resnet", "vit"])
def test_the_trained_models_learn_the_classes(mini_cifar: MiniCifar, architecture: str) -> None:
    logits, labels = _classified(mini_cifar, architecture, retrained=False)
    accuracy = top1_accuracy(logits, labels, what="test")
    assert accuracy >= ACCURACY_FLOOR[architecture]
    assert accuracy == pytest.approx(mini_cifar.report[f"{architecture}-base.test_accuracy"], abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["resnet", "vit"])
def test_the_retrained_models_never_saw_the_forget_class(mini_cifar: MiniCifar, architecture: str) -> None:
    logits, labels = _classified(mini_cifar, architecture, retrained=True)
    kept = labels != FORGET_CLASS
    assert top1_accuracy(logits[kept], labels[kept], what="retain test") >= ACCURACY_FLOOR[architecture]
    assert confusion_row(logits, labels, FORGET_CLASS, what="test")[FORGET_CLASS] == 0.0
