"""Image records (service.datasets.images): decoding under a pixel bound, labels, Parquet image
columns and ImageFolders, on real scans (scikit-learn's digits) encoded by Pillow."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from pydantic import ValidationError

from api_schemas.records import DatasetColumns, DatasetReference
from service.config import Settings
from service.datasets.images import (
    ImageRecord,
    check_record_kinds,
    decode_image,
    folder_fingerprint,
    image_column_value,
    image_folder,
    is_image_record,
    list_image_folder,
    resolve_label,
)
from service.datasets.refs import check_reference, resolve_reference, submitted_reference
from service.datasets.spool import spool_records
from service.errors import Conflict, InvalidInput, PayloadTooLarge
from tests.helpers.images import b64, digit_image, digit_record, digits, encode, png_bomb

MAX_PIXELS = Settings().max_image_pixels
ID2LABEL = dict(enumerate(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]))


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_lossless_formats_decode_to_the_scan_exactly(fmt: str) -> None:
    for index in (0, 7, 1796):
        image = decode_image(encode(digit_image(index), fmt), f"record {index}", MAX_PIXELS)
        assert image.size == (8, 8)
        np.testing.assert_array_equal(np.asarray(image.convert("L")), digits()[0][index])


def test_jpeg_decodes_close_to_the_scan() -> None:
    # JPEG is lossy: quality 95 on an 8×8 block keeps every pixel within a few grey levels.
    image = decode_image(encode(digit_image(3), "JPEG"), "record 3", MAX_PIXELS)
    assert image.format == "JPEG"
    error = np.abs(np.asarray(image.convert("L"), dtype=np.int16) - digits()[0][3].astype(np.int16))
    assert error.max() <= 16


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_record_round_trip_stores_the_file_as_sent(fmt: str) -> None:
    raw = digit_record(5, fmt)
    record = ImageRecord.from_mapping(raw, 5, MAX_PIXELS)
    assert is_image_record(raw) and record.kind == "image"
    assert record.to_json() == raw  # the stored form is the record as sent: same bytes, same label
    assert record.data == base64.b64decode(raw["image"])


def test_data_uri_prefix_is_read() -> None:
    raw = {"image": "data:image/png;base64," + b64(encode(digit_image(1), "PNG"))}
    assert ImageRecord.from_mapping(raw, 0, MAX_PIXELS).data == encode(digit_image(1), "PNG")


def test_bomb_over_the_setting_is_413_naming_the_record_before_decoding() -> None:
    bomb = png_bomb(8000, 6000)  # 48 megapixels (48 MB of grey) in ~50 kB
    assert len(bomb) < 100_000 and 8000 * 6000 > MAX_PIXELS
    with pytest.raises(
        PayloadTooLarge, match=r"record 4: the image is 8000×6000 = 48000000 pixels.*ENGRAM_MAX_IMAGE_PIXELS"
    ):
        ImageRecord.from_mapping({"image": b64(bomb)}, 4, MAX_PIXELS)


def test_bomb_past_pillows_own_bound_is_413_too() -> None:
    # Pillow refuses anything over 2 × its MAX_IMAGE_PIXELS (~179 Mpx) in Image.open itself.
    with pytest.raises(PayloadTooLarge, match=r"dataset row 9: the image is more pixels than Pillow opens"):
        decode_image(png_bomb(20_000, 10_000), "dataset row 9", 178_956_970)


def test_a_smaller_bound_refuses_a_digit() -> None:
    with pytest.raises(PayloadTooLarge, match="record 0: the image is 8×8 = 64 pixels, more than 63"):
        decode_image(encode(digit_image(0), "PNG"), "record 0", 63)


def test_truncated_file_is_422_naming_the_record() -> None:
    data = encode(Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)), "PNG")
    with pytest.raises(InvalidInput, match="record 2: the PNG image is truncated or corrupt"):
        ImageRecord.from_mapping({"image": b64(data[: len(data) // 2])}, 2, MAX_PIXELS)


def test_corrupt_header_is_422_naming_the_record() -> None:
    data = bytearray(encode(digit_image(0), "PNG"))
    data[16:24] = b"\xff" * 8  # IHDR's width and height: its CRC no longer matches
    with pytest.raises(InvalidInput, match="dataset line 3: the PNG image cannot be read"):
        decode_image(bytes(data), "dataset line 3", MAX_PIXELS)


@pytest.mark.parametrize(("fmt", "named"), [("GIF", "a GIF"), ("BMP", "a BMP"), ("TIFF", "a TIFF")])
def test_unsupported_format_is_named(fmt: str, named: str) -> None:
    with pytest.raises(InvalidInput, match=f"record 1: the image is {named}; send a PNG, JPEG or WebP file"):
        ImageRecord.from_mapping({"image": b64(encode(digit_image(0), fmt))}, 1, MAX_PIXELS)


def test_text_bytes_are_not_an_image() -> None:
    with pytest.raises(InvalidInput, match="record 0: the image is not an image file"):
        ImageRecord.from_mapping({"image": b64(b"hello, world")}, 0, MAX_PIXELS)


def test_animated_webp_is_refused() -> None:
    frames = [digit_image(i, rgb=True) for i in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="WEBP", save_all=True, append_images=frames[1:], lossless=True)
    with pytest.raises(InvalidInput, match=r"record 0: the WEBP image is animated \(3 frames\)"):
        ImageRecord.from_mapping({"image": b64(buffer.getvalue())}, 0, MAX_PIXELS)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"image": "not base64!"}, "record 6: 'image' is not valid base64"),
        ({"image": None}, "record 6: 'image' must be the base64 of a PNG, JPEG or WebP file, got null"),
        ({"image": 12}, "got int"),
        ({"image": "AAAA", "text": "x"}, "record 6: an image record has only 'image' and 'label', got 'text'"),
        ({"image": "iVBORw0KGgo=", "label": True}, "'label' must be a class id"),
        ({"image": "iVBORw0KGgo=", "label": -1}, "'label' -1 is negative"),
        ("a string", "record 6 is not a JSON object"),
    ],
)
def test_malformed_records_are_named(raw: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(")):
        ImageRecord.from_mapping(raw, 6, MAX_PIXELS)


def test_labels_resolve_by_id_and_by_name() -> None:
    assert resolve_label(3, ID2LABEL, "record 0") == 3
    assert resolve_label("seven", ID2LABEL, "record 0") == 7
    assert resolve_label(None, ID2LABEL, "record 0") is None


def test_unknown_label_name_lists_known_ones() -> None:
    with pytest.raises(InvalidInput, match=r"record 11: 'label' 'tree' is no class name .*'zero', 'one'.*\(10 in all\)"):
        resolve_label("tree", ID2LABEL, "record 11")
    with pytest.raises(InvalidInput, match=r"record 2: 'label' 10 is no class of the model \(ids 0 to 9\)"):
        resolve_label(10, ID2LABEL, "record 2")


# ---------------------------------------------------------------- Parquet image columns


def _hf_image_table(paths: list[str | None], data: list[bytes | None]) -> pa.Table:
    """A table as ``datasets`` writes an ``Image`` feature: a struct of ``bytes`` and ``path``."""
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = [{"bytes": d, "path": p} for d, p in zip(data, paths, strict=True)]
    return pa.table({"img": pa.array(cells, type=struct), "digit": pa.array([0] * len(cells))})


def test_parquet_struct_and_base64_columns_give_the_same_record(tmp_path: Path) -> None:
    png = encode(digit_image(9, rgb=True), "PNG")
    pq.write_table(_hf_image_table(["9.png"], [png]), tmp_path / "hf.parquet")
    pq.write_table(pa.table({"b": [b64(png)], "raw": pa.array([png], pa.binary())}), tmp_path / "b64.parquet")
    struct_cell = pq.read_table(tmp_path / "hf.parquet").column("img").to_pylist()[0]
    base64_cell = pq.read_table(tmp_path / "b64.parquet").column("b").to_pylist()[0]
    binary_cell = pq.read_table(tmp_path / "b64.parquet").column("raw").to_pylist()[0]
    values = {image_column_value(cell, "dataset row 0") for cell in (struct_cell, base64_cell, binary_cell)}
    assert values == {b64(png)}
    record = ImageRecord.from_mapping({"image": values.pop(), "label": 9}, "dataset row 0", MAX_PIXELS)
    assert record.data == png


def test_parquet_path_only_image_is_refused_without_reading_it(tmp_path: Path) -> None:
    secret = tmp_path / "secret.png"
    secret.write_bytes(encode(digit_image(0), "PNG"))
    pq.write_table(_hf_image_table([str(secret)], [None]), tmp_path / "paths.parquet")
    cell = pq.read_table(tmp_path / "paths.parquet").column("img").to_pylist()[0]
    with pytest.raises(InvalidInput, match="dataset row 0: the image has no bytes .*is not read"):
        image_column_value(cell, "dataset row 0")


def test_parquet_null_image_is_refused() -> None:
    with pytest.raises(InvalidInput, match="dataset row 4: the image column holds null"):
        image_column_value(None, "dataset row 4")


# ---------------------------------------------------------------- ImageFolder


def _folder(root: Path, per_class: dict[str, list[int]]) -> Path:
    for label, indices in per_class.items():
        (root / label).mkdir(parents=True)
        for index in indices:
            (root / label / f"{index:04d}.png").write_bytes(encode(digit_image(index), "PNG"))
    return root


def test_image_folder_reads_classes_and_files_in_sorted_order(tmp_path: Path) -> None:
    root = _folder(tmp_path / "digits", {"one": [11, 1], "zero": [10, 0]})
    (root / "zero" / ".DS_Store").write_bytes(b"finder")  # hidden entries are a file browser's own
    records = list(image_folder(root, max_files=10, max_bytes=1 << 20))
    assert [where for where, _ in records] == [
        "dataset file one/0001.png",
        "dataset file one/0011.png",
        "dataset file zero/0000.png",
        "dataset file zero/0010.png",
    ]
    assert [r["label"] for _, r in records] == ["one", "one", "zero", "zero"]
    first = ImageRecord.from_mapping(records[0][1], records[0][0], MAX_PIXELS)
    np.testing.assert_array_equal(np.asarray(decode_image(first.data, "x", MAX_PIXELS)), digits()[0][1])


def test_image_folder_link_leaving_the_folder_is_refused(tmp_path: Path) -> None:
    root = _folder(tmp_path / "digits", {"zero": [0]})
    outside = tmp_path / "outside.png"
    outside.write_bytes(encode(digit_image(5), "PNG"))
    os.symlink(outside, root / "zero" / "0005.png")
    with pytest.raises(InvalidInput, match="'0005.png' in zero is a link that leads out of the folder"):
        list_image_folder(root, 10, 1 << 20)


def test_image_folder_link_to_a_class_outside_is_refused(tmp_path: Path) -> None:
    root = _folder(tmp_path / "digits", {"zero": [0]})
    _folder(tmp_path / "elsewhere", {"one": [1]})
    os.symlink(tmp_path / "elsewhere" / "one", root / "one")
    with pytest.raises(InvalidInput, match="'one' in digits is a link that leads out of the folder"):
        list_image_folder(root, 10, 1 << 20)


def test_image_folder_link_inside_is_followed(tmp_path: Path) -> None:
    root = _folder(tmp_path / "digits", {"zero": [0], "one": [1]})
    os.symlink(root / "zero" / "0000.png", root / "one" / "0000.png")
    assert [i.relative for i in list_image_folder(root, 10, 1 << 20)] == ["one/0000.png", "one/0001.png", "zero/0000.png"]


def test_image_folder_bounds(tmp_path: Path) -> None:
    root = _folder(tmp_path / "digits", {"zero": [0, 10, 20], "one": [1]})
    with pytest.raises(PayloadTooLarge, match="more than 3 images .*ENGRAM_MAX_RECORDS"):
        list_image_folder(root, 3, 1 << 20)
    size = sum(p.stat().st_size for p in root.rglob("*.png"))
    with pytest.raises(PayloadTooLarge, match="ENGRAM_MAX_DATASET_BYTES"):
        list_image_folder(root, 10, size - 1)
    assert len(list_image_folder(root, 4, size)) == 4


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: (root / "notes.txt").write_text("x"), "holds 'notes.txt' beside its class folders"),
        (lambda root: (root / "zero" / "readme.txt").write_text("x"), r"zero/readme.txt is not a .png"),
        (lambda root: (root / "zero" / "nested").mkdir(), "zero/nested is a folder"),
        (lambda root: os.mkfifo(root / "zero" / "pipe.png"), "'pipe.png' in zero is neither a folder nor a regular file"),
    ],
)
def test_image_folder_refuses_what_is_no_class_image(tmp_path: Path, make: object, message: str) -> None:
    root = _folder(tmp_path / "digits", {"zero": [0]})
    make(root)  # type: ignore[operator]
    with pytest.raises(InvalidInput, match=message):
        list_image_folder(root, 10, 1 << 20)


def test_empty_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInput, match="has no class folders"):
        list_image_folder(tmp_path / "empty", 10, 1 << 20)


def test_folder_fingerprint_changes_with_any_file(tmp_path: Path) -> None:
    root = _folder(tmp_path / "digits", {"zero": [0], "one": [1]})
    before = folder_fingerprint(list_image_folder(root, 10, 1 << 20))
    assert folder_fingerprint(list_image_folder(root, 10, 1 << 20)) == before
    (root / "one" / "0001.png").write_bytes(encode(digit_image(2), "PNG"))
    assert folder_fingerprint(list_image_folder(root, 10, 1 << 20)) != before


# ---------------------------------------------------------------- by reference: Parquet and ImageFolder, end to end


def _stored(spooled_path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in spooled_path.read_text().splitlines()]


def test_parquet_image_dataset_spools_the_records_an_inline_post_would(tmp_path: Path) -> None:
    indices = [0, 1, 2, 3]
    pngs = [encode(digit_image(i, rgb=True), "PNG") for i in indices]
    table = _hf_image_table([f"{i}.png" for i in indices], pngs)  # default columns: image + label
    table = pa.table({"image": table.column("img"), "label": pa.array([int(digits()[1][i]) for i in indices])})
    pq.write_table(table, tmp_path / "digits.parquet", row_group_size=3)
    settings = Settings(dataset_roots=str(tmp_path))
    reference = submitted_reference({"uri": f"file://{tmp_path}/digits.parquet"}, settings)
    (tmp_path / "job").mkdir()
    spooled = resolve_reference(reference, settings, tmp_path / "job")
    inline = spool_records([digit_record(i) for i in indices], tmp_path / "inline.jsonl", 10)
    assert spooled.kinds == {"image"} and spooled.first == {"image": "dataset row 0"}
    assert spooled.digest == inline.digest  # the same records whichever way they came
    assert _stored(spooled.path)[1] == {"image": b64(pngs[1]), "label": 1}


def test_parquet_column_mapping_and_a_bad_cell_named_by_row(tmp_path: Path) -> None:
    good = b64(encode(digit_image(0), "PNG"))
    pq.write_table(pa.table({"pic": [good, good, b64(b"GIF89a....")], "y": [0, 0, 0]}), tmp_path / "d.parquet")
    settings = Settings(dataset_roots=str(tmp_path))
    raw = {"uri": f"file://{tmp_path}/d.parquet", "columns": {"image": "pic", "label": "y"}}
    with pytest.raises(InvalidInput, match="dataset row 2: the image is a GIF"):
        resolve_reference(submitted_reference(raw, settings), settings, tmp_path)


def test_image_folder_reference_spools_labelled_records(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data" / "digits", {"zero": [0, 10], "one": [1]})
    settings = Settings(dataset_roots=str(tmp_path / "data"))
    raw = {"uri": f"file://{root}", "rows": {"start": 1}}
    assert check_reference(raw, settings) == {"uri": f"file://{root}", "format": "imagefolder", "rows": {"start": 1}}
    reference = submitted_reference(raw, settings)
    assert reference.fingerprint is not None and reference.fingerprint["files"] == 3
    spooled = resolve_reference(reference, settings, tmp_path)
    assert spooled.first == {"image": "dataset file zero/0000.png"}  # row 0 (one/0001.png) skipped
    assert [r["label"] for r in _stored(spooled.path)] == ["zero", "zero"]
    (root / "zero" / "0010.png").write_bytes(encode(digit_image(20), "PNG"))
    with pytest.raises(Conflict, match="changed since it was posted"):
        resolve_reference(reference, settings, tmp_path)


def test_image_folder_reference_refusals(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data" / "digits", {"zero": [0]})
    settings = Settings(dataset_roots=str(tmp_path / "data"))
    with pytest.raises(InvalidInput, match="dataset.columns does not apply to an ImageFolder"):
        check_reference({"uri": f"file://{root}", "columns": {"image": "x"}}, settings)
    outside = tmp_path / "secret.png"
    outside.write_bytes(encode(digit_image(3), "PNG"))
    os.symlink(outside, root / "zero" / "0003.png")
    with pytest.raises(InvalidInput, match="link that leads out of the folder"):
        submitted_reference({"uri": f"file://{root}"}, settings)


def test_records_of_the_other_kind_are_named_with_the_models_kind(tmp_path: Path) -> None:
    mixed = spool_records([digit_record(0), {"text": "a cat"}, digit_record(1)], tmp_path / "mixed.jsonl", 10)
    assert mixed.first == {"image": "record 0", "text": "record 1"}
    with pytest.raises(InvalidInput, match="record 1 is a text record, but model vit/tiny is an image model"):
        check_record_kinds(mixed.first, "vit/tiny", "image")
    with pytest.raises(InvalidInput, match="record 0 is an image record, but model llama/tiny is a text model"):
        check_record_kinds(mixed.first, "llama/tiny", "text")
    check_record_kinds({"image": "record 0"}, "vit/tiny", "image")
    check_record_kinds({"messages": "dataset line 1", "text": "dataset line 2"}, "llama/tiny", "text")


def test_dataset_columns_map_an_image_and_its_label() -> None:
    assert DatasetColumns(image="img", label="fine_label").model_dump(exclude_none=True) == {
        "image": "img",
        "label": "fine_label",
    }
    assert DatasetReference(uri="file:///data/digits", format="imagefolder").format == "imagefolder"
    with pytest.raises(ValidationError, match="'image' and optionally 'label'"):
        DatasetColumns(text="caption", label="y")
