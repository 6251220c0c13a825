"""What an image costs, told before it is paid (issue 35, finding 3): the model's resize read from its
processor (service.engine.image_resize), an image refused from its header when the resize would
hold more than ``ENGRAM_MAX_IMAGE_PIXELS`` or when it is too far from square, in every path that
reads images (records, a collection job's stored images, evaluate and calibrate probes), and a file
checked whole without its pixels decoded (service.datasets.images.check_image_file)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import ResNetForImageClassification

from engram_fixtures.vision import make_tiny_resnet, make_tiny_vit
from service.concepts.image_collection import image_statistics
from service.datasets.images import MAX_IMAGE_ASPECT, ImageRecord, check_image_file, decode_image
from service.datasets.spool import spool_records
from service.engine.editable import editable_layers
from service.engine.image_resize import ResizePath
from service.engine.images import load_image_processor
from service.errors import InvalidInput, JobFailed
from service.evaluation.classifier_run import Classifier, probe_pixels
from tests.helpers.images import b64, digit_record, encode

MAX_PIXELS = 40_000_000


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), 0).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def resnet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ResNetForImageClassification]:
    """A tiny ResNet with the ConvNeXT processor it ships with: shortest edge 16, ``crop_pct`` 0.875."""
    folder = make_tiny_resnet(tmp_path_factory.mktemp("resnet"), num_labels=10)
    return folder, ResNetForImageClassification.from_pretrained(folder).eval()


# ---------------------------------------------------------------- the resize, read from the processor


def test_convnext_shortest_edge_keeps_the_ratio(resnet: tuple[Path, ResNetForImageClassification]) -> None:
    path = ResizePath.of(load_image_processor(resnet[0]))
    assert path == ResizePath(True, (("shortest_edge", 16),), 0.875)
    assert path.output(1, 40_000) == (18, 720_000)  # 16 / 0.875 = 18 on the short side, the ratio kept
    assert path.output(40_000, 1) == (720_000, 18)
    assert path.output(64, 48) == (24, 18)
    assert path.path_pixels(1, 40_000) == 18 * 720_000


def test_a_fixed_size_costs_pillows_horizontal_pass_on_a_tall_image(tmp_path: Path) -> None:
    path = ResizePath.of(load_image_processor(make_tiny_vit(tmp_path / "vit")))
    assert path.output(1, 1_000_000) == (16, 16)
    assert path.path_pixels(1, 1_000_000) == 16 * 1_000_000  # 16 wide at the input's height, then 16 high
    assert path.path_pixels(1_000_000, 1) == 1_000_000  # the wide one: the image itself is the most


@pytest.mark.parametrize(
    ("path", "size", "expected"),
    [
        (ResizePath(True, (("shortest_edge", 384),), 0.875), (100, 3000), (384, 384)),  # 384 and up: a square
        (ResizePath(True, (("shortest_edge", 800), ("longest_edge", 1333))), (100, 3000), (44, 1333)),
        (ResizePath(True, (("longest_edge", 512),)), (2048, 1024), (512, 256)),
        (ResizePath(True, (("max_height", 100), ("max_width", 200))), (1000, 1000), (100, 100)),
        (ResizePath(False, (("height", 16), ("width", 16))), (640, 480), (640, 480)),
        (ResizePath(True, ()), (640, 480), (640, 480)),  # a size it does not know: the image itself
    ],
)
def test_each_size_rule(path: ResizePath, size: tuple[int, int], expected: tuple[int, int]) -> None:
    assert path.output(*size) == expected


def test_sizes_read_from_dicts_and_ints() -> None:
    class Processor:
        size = 224
        do_resize = True

    assert ResizePath.of(Processor()).output(10, 1000) == (224, 224)
    Processor.size = {"shortest_edge": 224, "nonsense": "x"}  # type: ignore[assignment]
    assert ResizePath.of(Processor()).size == (("shortest_edge", 224),)


# ---------------------------------------------------------------- refused before decoding, naming the record


def test_a_resize_past_the_bound_is_refused_before_the_pixels_are_decoded() -> None:
    path = ResizePath(True, (("shortest_edge", 16),), 0.875)
    whole = png(900, 10)  # 90:1, 9,000 pixels: within the aspect bound and the pixel bound
    cut = whole[: len(whole) - 20]  # no IEND: a decode would fail "truncated"; the cost is told first
    with pytest.raises(InvalidInput) as refused:
        decode_image(cut, "record 4", 20_000, path)
    assert refused.value.detail == (
        "record 4: the image is 900×10; the model's image processor resizes it to 1620×18, holding 29160 pixels "
        "on the way, more than 20000 (the limit, ENGRAM_MAX_IMAGE_PIXELS); crop it closer to square first"
    )
    assert decode_image(whole, "record 4", 30_000, path).size == (900, 10)  # within the bound: decoded


def test_an_image_too_far_from_square_is_refused_from_its_header() -> None:
    assert ImageRecord.from_mapping({"image": b64(png(MAX_IMAGE_ASPECT, 1))}, 0, MAX_PIXELS).data
    for size in ((MAX_IMAGE_ASPECT + 1, 1), (1, 1_000_000)):
        data = png(*size, mode="1")
        assert len(data) < 10_000
        with pytest.raises(InvalidInput, match=rf"record 2: the image is {size[0]}×{size[1]}, its longer side over 100"):
            ImageRecord.from_mapping({"image": b64(data)}, 2, MAX_PIXELS)


def test_a_collection_job_refuses_the_record_its_processor_would_blow_up(
    resnet: tuple[Path, ResNetForImageClassification], tmp_path: Path
) -> None:
    folder, model = resnet
    records = [digit_record(0), {"image": b64(png(900, 10))}]
    stored = spool_records(records, tmp_path / "d.jsonl", 10)
    with pytest.raises(InvalidInput, match=r"record 1: the image is 900×10; .* resizes it to 1620×18"):
        image_statistics(model, folder, stored.path, editable_layers(model), batch_size=2, max_pixels=20_000)


def test_an_evaluate_or_calibrate_probe_is_refused_by_name(resnet: tuple[Path, ResNetForImageClassification]) -> None:
    """``probe_pixels`` reads the probes of evaluate and of calibrate's classifier goal alike."""
    classifier = Classifier(resnet[1], resnet[0])
    probes = [digit_record(0), {"image": b64(png(900, 10)), "label": 1}]
    with pytest.raises(JobFailed, match=r"forget\[1\]: the image is 900×10; .* ENGRAM_MAX_IMAGE_PIXELS"):
        list(probe_pixels(classifier, probes, "forget", batch_size=4, max_pixels=20_000))
    strip = [{"image": b64(png(1, 40_000, mode="L")), "label": 1}]
    with pytest.raises(JobFailed, match=r"retain\[0\]: the image is 1×40000, its longer side over 100"):
        list(probe_pixels(classifier, strip, "retain", batch_size=4, max_pixels=MAX_PIXELS))


# ---------------------------------------------------------------- a file checked whole, its pixels never decoded


def test_a_truncated_jpeg_is_refused_at_submission() -> None:
    data = encode(Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)), "JPEG")
    check_image_file(data, "record 0", MAX_PIXELS)
    with pytest.raises(InvalidInput, match="record 0: the JPEG image is truncated or corrupt"):
        check_image_file(data[: len(data) // 2], "record 0", MAX_PIXELS)


def test_a_png_whose_data_was_altered_is_refused_by_its_crc() -> None:
    data = bytearray(png(64, 64))
    data[-20] ^= 0xFF  # a byte of the IDAT chunk: its CRC no longer matches
    with pytest.raises(InvalidInput, match="record 0: the PNG image is truncated or corrupt"):
        check_image_file(bytes(data), "record 0", MAX_PIXELS)


def test_a_jpeg_with_bytes_after_its_end_marker_or_an_exif_thumbnail_is_whole() -> None:
    image = Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3))
    check_image_file(encode(image, "JPEG") + b"trailing bytes a camera appended", "record 0", MAX_PIXELS)
    exif = Image.Exif()
    exif[0x010F] = "a camera"
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif.tobytes())
    data = buffer.getvalue()
    check_image_file(data, "record 0", MAX_PIXELS)
    with pytest.raises(InvalidInput, match="record 0: the JPEG image is truncated or corrupt"):
        check_image_file(data[:-2], "record 0", MAX_PIXELS)
