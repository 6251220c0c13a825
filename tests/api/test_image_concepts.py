"""Image concepts at the door, through a real server (embedded mode, file storage): what an image
classifier and a text model accept as records is told at submission, naming the record.

A tiny ViT (engram_fixtures.vision, with its preprocessor_config.json) and a tiny Llama are
registered; the records are scikit-learn's digits encoded by Pillow. A text record posted for the
ViT, or an image record for the Llama, is a 422 naming the record and the model's kind (before,
the ViT's concept was accepted and its job failed on a tokenizer the folder does not have); a
decompression bomb is a 413 naming the record; an image model without its processor config is
refused at registration. Image concepts collect: inline, as a Parquet file stored the way the
``datasets`` library stores images, and as an ImageFolder, the same images give the same dataset and
statistics counting every patch token of every image.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server, wait_for_job
from engram_fixtures.models import make_tiny_llama
from engram_fixtures.vision import make_tiny_vit
from tests.helpers.api import assert_problem, jsonl, register_model, unchanged
from tests.helpers.images import b64, digit_image, digit_record, digits, encode, png_bomb

VIT, LLAMA = "images/vit", "images/llama"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("image-concepts")
    make_tiny_vit(path / "models" / "vit", num_labels=10)
    make_tiny_llama(path / "models" / "llama")
    shutil.copytree(path / "models" / "vit", path / "models" / "vit-bare")
    (path / "models" / "vit-bare" / "preprocessor_config.json").unlink()
    (path / "datasets").mkdir()
    return path


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[LiveServer]:
    live = start_server(
        root / "store",
        root / "models",
        root / "server.log",
        ENGRAM_CACHE_DIR=str(root / "cache"),
        ENGRAM_DATASET_ROOTS=str(root / "datasets"),
    )
    try:
        for model_id, folder in ((VIT, "vit"), (LLAMA, "llama")):
            register_model(live.client, model_id, f"file://{root / 'models' / folder}")
        yield live
    finally:
        stop_server(live)


def post(api: httpx.Client, name: str, model: str, records: list[dict[str, Any]]) -> httpx.Response:
    return api.post("/concepts", json={"name": name, "models": [model], "records": records})


def test_text_record_for_an_image_model_is_422_naming_it(server: LiveServer) -> None:
    records: list[dict[str, Any]] = [digit_record(0), digit_record(1), {"text": "the digit zero"}]
    with unchanged(server):
        response = post(server.client, "zero-mixed", VIT, records)
        assert_problem(response, 422, "record 2 is a text record", f"model {VIT} is an image model")


def test_uploaded_text_records_for_an_image_model_are_422_naming_the_line(server: LiveServer) -> None:
    files = {"dataset": ("zero.jsonl", jsonl([{"text": "the digit zero"}]), "application/jsonl")}
    with unchanged(server):
        response = server.client.post("/concepts", data={"name": "zero-upload", "models": VIT}, files=files)
        assert_problem(response, 422, "is a text record", f"model {VIT} is an image model")


def test_image_record_for_a_text_model_is_422_naming_it(server: LiveServer) -> None:
    with unchanged(server):
        response = post(server.client, "zero-pictures", LLAMA, [{"text": "zero"}, digit_record(0, "WEBP")])
        assert_problem(response, 422, "record 1 is an image record", f"model {LLAMA} is a text model")


def test_an_image_concept_for_both_kinds_names_the_text_model(server: LiveServer) -> None:
    with unchanged(server):
        response = server.client.post(
            "/concepts", json={"name": "zero-both", "models": [VIT, LLAMA], "records": [digit_record(0, "JPEG")]}
        )
        assert_problem(response, 422, "record 0 is an image record", f"model {LLAMA} is a text model")


def test_a_label_the_classifier_lacks_is_422_naming_the_record_and_its_classes(server: LiveServer) -> None:
    # the tiny ViT has 10 classes, class_0 … class_9: "zero" and 99 are neither a name nor an id of it
    # (before, the concept was accepted and its collection job failed on the label)
    with unchanged(server):
        named = post(server.client, "zero-named", VIT, [digit_record(0, label="class_0"), digit_record(0, label="zero")])
        assert_problem(named, 422, "record 1: 'label' 'zero' is no class name of model images/vit", "'class_0'")
        numbered = post(server.client, "zero-numbered", VIT, [digit_record(0, label=99)])
        assert_problem(numbered, 422, "record 0: 'label' 99 is no class of model images/vit (ids 0 to 9)")


def test_an_uploaded_label_the_classifier_lacks_is_422_naming_the_line(server: LiveServer) -> None:
    lines = [digit_record(0, label=0), digit_record(1, label="class_1"), digit_record(2, label=10)]
    files = {"dataset": ("digits.jsonl", jsonl(lines), "application/jsonl")}
    with unchanged(server):
        response = server.client.post("/concepts", data={"name": "digits-upload", "models": VIT}, files=files)
        assert_problem(response, 422, "dataset line 3: 'label' 10 is no class of model images/vit (ids 0 to 9)")


def test_decompression_bomb_is_413_naming_the_record(server: LiveServer) -> None:
    with unchanged(server):
        response = post(server.client, "bomb", VIT, [digit_record(0), {"image": b64(png_bomb(8000, 6000))}])
        assert_problem(response, 413, "record 1: the image is 8000×6000", "ENGRAM_MAX_IMAGE_PIXELS")


def test_corrupt_image_is_422_naming_the_record(server: LiveServer) -> None:
    truncated = digit_record(3)
    truncated["image"] = str(truncated["image"])[:40]
    with unchanged(server):
        assert_problem(post(server.client, "broken", VIT, [truncated]), 422, "record 0: the PNG image")


def test_image_model_without_its_processor_config_is_refused_at_registration(server: LiveServer, root: Path) -> None:
    source = f"file://{root / 'models' / 'vit-bare'}"
    with unchanged(server):
        response = server.client.post("/models", json={"model_id": "images/bare", "source": source})
        assert_problem(response, 422, "an image model needs the preprocessor_config.json")


# ---------------------------------------------------------------- image concepts collect, whichever way they come

ZEROS = [i for i in range(200) if digits()[1][i] == 0][:6]  # six scans of the digit 0
PATCH_TOKENS = 1 + (16 // 4) ** 2  # [CLS] and 4×4 patches of a 16×16 image


def collected(api: httpx.Client, response: httpx.Response) -> dict[str, Any]:
    """The concept once its one collection job finished (which must succeed)."""
    assert response.status_code == 202, response.text
    (job,) = response.json()["jobs"]
    finished = wait_for_job(api, job["job_id"], timeout=300)
    assert finished["status"] == "succeeded", finished
    return api.get(f"/concepts/{response.json()['concept']['name']}").json()


def test_image_concept_collects_every_patch_token(server: LiveServer) -> None:
    records = [digit_record(i, label="class_0") for i in ZEROS]
    concept = collected(server.client, post(server.client, "zeros-inline", VIT, records))
    assert concept["num_records"] == len(ZEROS)
    assert concept["models"][VIT]["tokens"] == len(ZEROS) * PATCH_TOKENS


def test_parquet_and_image_folder_give_the_inline_dataset(server: LiveServer, root: Path) -> None:
    pngs = [encode(digit_image(i, rgb=True), "PNG") for i in ZEROS]
    inline = collected(
        server.client, post(server.client, "zeros-same", VIT, [{"image": b64(p), "label": "class_0"} for p in pngs])
    )
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": p, "path": f"{i}.png"} for p, i in zip(pngs, ZEROS, strict=True)], type=struct)
    pq.write_table(pa.table({"img": images, "digit": ["class_0"] * len(pngs)}), root / "datasets" / "zeros.parquet")
    reference = {"uri": f"file://{root / 'datasets' / 'zeros.parquet'}", "columns": {"image": "img", "label": "digit"}}
    body = {"name": "zeros-parquet", "models": [VIT], "dataset": reference}
    parquet = collected(server.client, server.client.post("/concepts", json=body))
    folder = root / "datasets" / "zeros" / "class_0"
    folder.mkdir(parents=True)
    for index, png in zip(ZEROS, pngs, strict=True):
        (folder / f"{index:04d}.png").write_bytes(png)
    body = {"name": "zeros-folder", "models": [VIT], "dataset": {"uri": f"file://{folder.parent}"}}
    image_folder = collected(server.client, server.client.post("/concepts", json=body))
    assert image_folder["dataset"]["format"] == "imagefolder"
    # the same records in the same order (file names sort as the rows do): one dataset, one statistic
    assert parquet["dataset_digest"] == image_folder["dataset_digest"] == inline["dataset_digest"]
    assert image_folder["models"][VIT]["tokens"] == len(ZEROS) * PATCH_TOKENS


def test_image_records_by_reference_fail_a_text_models_job_naming_the_row(server: LiveServer, root: Path) -> None:
    """A reference is read only by the job: its records meet the model's kind there (a 422, not a 500)."""
    (root / "datasets" / "pictures.jsonl").write_bytes(jsonl([{"text": "zero"}, digit_record(0), digit_record(1)]))
    body = {"name": "pictures", "models": [LLAMA], "dataset": {"uri": f"file://{root / 'datasets' / 'pictures.jsonl'}"}}
    response = server.client.post("/concepts", json=body)
    assert response.status_code == 202, response.text
    (job,) = response.json()["jobs"]
    failed = wait_for_job(server.client, job["job_id"], timeout=300)
    assert failed["status"] == "failed" and failed["error"]["status"] == 422, failed
    assert (
        "dataset row 1 is an image record" in failed["error"]["detail"]
        and f"model {LLAMA} is a text model" in (failed["error"]["detail"])
    )
