"""An image concept's collection job body (service.concepts.image_collection): the stored records of
an image dataset, decoded and processed, give the statistics the same images give fed directly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import ViTForImageClassification

from engram_fixtures.vision import make_tiny_vit
from service.concepts.image_collection import image_statistics
from service.datasets.spool import spool_records
from service.datasets.stored import check_text_records, count_records
from service.engine.collect import PixelBatch, collect_statistics
from service.engine.editable import editable_layers
from service.engine.images import load_image_processor, pixel_batches
from service.errors import InvalidInput, PayloadTooLarge
from tests.helpers.images import digit_image, digit_record

MAX_PIXELS = 1 << 20


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ViTForImageClassification]:
    folder = make_tiny_vit(tmp_path_factory.mktemp("vit"), num_labels=10)  # id2label: class_0 … class_9
    return folder, ViTForImageClassification.from_pretrained(folder).eval()


def test_stored_image_records_give_the_statistics_of_their_images(
    vit: tuple[Path, ViTForImageClassification], tmp_path: Path
) -> None:
    folder, model = vit
    indices = list(range(7))
    stored = spool_records([digit_record(i, ["PNG", "WEBP"][i % 2]) for i in indices], tmp_path / "d.jsonl", 10)
    layers = editable_layers(model)
    seen: list[int] = []
    stats = image_statistics(model, folder, stored.path, layers, batch_size=3, max_pixels=MAX_PIXELS, on_batch=seen.append)
    assert seen == [3, 3, 1] and count_records(stored.path) == 7

    processor = load_image_processor(folder)
    direct = [PixelBatch(b) for b in pixel_batches(processor, [digit_image(i, rgb=True) for i in indices], 7, 3)]
    expected = collect_statistics(model, direct, layers)
    assert stats.layer_group == expected.layer_group and stats.counts == expected.counts
    for group, total in expected.sums.items():  # batches of 3 against one of 7: float32 products summed
        torch.testing.assert_close(stats.sums[group], total, rtol=1e-5, atol=1e-6)


def test_a_label_the_model_does_not_have_fails_naming_the_record(
    vit: tuple[Path, ViTForImageClassification], tmp_path: Path
) -> None:
    folder, model = vit
    stored = spool_records([digit_record(0), digit_record(1, label="giraffe")], tmp_path / "d.jsonl", 10)
    with pytest.raises(InvalidInput, match="record 1: 'label' 'giraffe' is no class name of the model"):
        image_statistics(model, folder, stored.path, editable_layers(model), batch_size=4, max_pixels=MAX_PIXELS)


def test_a_text_record_or_an_image_past_the_workers_bound_is_named(
    vit: tuple[Path, ViTForImageClassification], tmp_path: Path
) -> None:
    folder, model = vit
    stored = spool_records([digit_record(0), {"text": "zero"}], tmp_path / "mixed.jsonl", 10)
    with pytest.raises(InvalidInput, match="record 1 is a text record"):
        image_statistics(model, folder, stored.path, editable_layers(model), batch_size=4, max_pixels=MAX_PIXELS)
    images = spool_records([digit_record(0)], tmp_path / "one.jsonl", 10)
    with pytest.raises(PayloadTooLarge, match="dataset row 5: the image is 8×8 = 64 pixels, more than 63"):
        image_statistics(model, folder, images.path, editable_layers(model), batch_size=4, max_pixels=63, first_row=5)


def test_a_text_model_meets_an_image_record_of_a_reference_by_name(tmp_path: Path) -> None:
    text = spool_records([{"text": "zero"}, {"prompt": "a", "completion": "b"}], tmp_path / "text.jsonl", 10)
    check_text_records(text.path, "llama/tiny", first_row=None)  # text only: nothing to say
    mixed = spool_records([{"text": "zero"}, digit_record(0)], tmp_path / "mixed.jsonl", 10)
    with pytest.raises(InvalidInput, match="dataset row 8 is an image record, but model llama/tiny is a text model"):
        check_text_records(mixed.path, "llama/tiny", first_row=7)
