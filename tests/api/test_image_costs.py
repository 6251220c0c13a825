"""What an image costs, checked before it is paid, through a real server (embedded mode, file storage,
its own job process): issue 35, findings 3 and 6.

- 6: image records posted for a text model, inline or uploaded, are refused (422, naming the
  record and the model's kind) without their pixels ever being decoded: the API's peak memory does not grow by what the
  images declare. Before, the API decoded every image first: 48 MB of RGB per 4000 × 4000 record.
- 3: a 1 × N strip (within ``ENGRAM_MAX_IMAGE_PIXELS``, a few kilobytes) is refused from its
  header, naming where it is and its size: posted inline (422 at submission) and in an ImageFolder
  reference (the job fails by name, its process's peak memory flat). Before, the job decoded it
  and the ResNet's ConvNeXT processor (``shortest_edge``: the ratio kept) resized it to 18 × 18·N
  on the way to its 16 × 16 crop: at N = 40,000 the job process peaked 120-170 MB higher (0 MB now),
  and the collection succeeded on a picture of nothing.

Memory is each process's peak resident set (``VmHWM``, from ``/proc``) over the requests, less what
was resident when they began (the peak reset first: ``clear_refs``).
"""

from __future__ import annotations

import io
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from engram_fixtures.live import LiveServer, start_server, stop_server, wait_for_job
from engram_fixtures.models import make_tiny_llama
from engram_fixtures.vision import make_tiny_resnet
from tests.helpers.api import assert_problem, jsonl, register_model, unchanged
from tests.helpers.images import b64, digit_image, digit_record, encode
from tests.helpers.job_process import job_process, peak_rss_bytes

RESNET, LLAMA = "costs/resnet", "costs/llama"
MB = 1 << 20
SQUARE = 4000  # a 4000 × 4000 RGB image: 48 MB decoded, ~50 KB as a PNG of one colour
STRIP = 40_000  # a 1 × 40,000 strip: 120-170 MB to resize on the old path, 160 bytes as a PNG
API_GROWTH_BOUND = 16 * MB  # under one decoded image's 48 MB: the API held none
JOB_GROWTH_BOUND = 32 * MB  # a quarter of what the strip's resize held


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def blank_rgb_png(width: int, height: int) -> bytes:
    """A valid black RGB PNG built row by row (the test never holds its pixels)."""
    compressor = zlib.compressobj(9)
    row = b"\x00" + bytes(3 * width)
    body = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def strip_png(length: int) -> bytes:
    """A 1 × ``length`` grey strip (one pixel wide), saved by Pillow."""
    buffer = io.BytesIO()
    Image.new("L", (1, length), 128).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("image-costs")
    make_tiny_resnet(path / "models" / "resnet", num_labels=10)
    make_tiny_llama(path / "models" / "llama")
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
        for model_id, folder in ((RESNET, "resnet"), (LLAMA, "llama")):
            register_model(live.client, model_id, f"file://{root / 'models' / folder}")
        yield live
    finally:
        stop_server(live)


def reset_peak(pid: int) -> int:
    """Start ``pid``'s peak resident set again from what is resident now; that resident size."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) * 1024


def post(api: httpx.Client, name: str, model: str, records: list[dict[str, Any]]) -> httpx.Response:
    return api.post("/concepts", json={"name": name, "models": [model], "records": records})


def upload(api: httpx.Client, name: str, model: str, records: list[dict[str, Any]]) -> httpx.Response:
    """The records as a multipart JSONL upload."""
    files = {"dataset": ("d.jsonl", jsonl(records), "application/x-ndjson")}
    return api.post("/concepts", data={"name": name, "models": model}, files=files)


def test_images_for_a_text_model_are_422_without_being_decoded(server: LiveServer) -> None:
    square = b64(blank_rgb_png(SQUARE, SQUARE))
    assert len(square) < 200_000  # what the request carries: ~1/300 of what it declares
    api_pid = server.process.pid
    post(server.client, "warm", LLAMA, [{"text": "warm the route up"}, digit_record(0)])  # same path, a tiny image
    upload(server.client, "warm", LLAMA, [{"text": "warm the route up"}, digit_record(0)])
    before = reset_peak(api_pid)
    with unchanged(server):
        for attempt, send in enumerate((post, upload, post, upload)):
            response = send(server.client, f"squares-{attempt}", LLAMA, [{"image": square}, {"image": square}])
            named = "record 0" if send is post else "dataset line 1"
            assert_problem(response, 422, f"{named} is an image record", f"model {LLAMA} is a text model")
    growth = peak_rss_bytes(api_pid) - before
    print(f"\nAPI peak RSS growth over 4 requests of 2 × {SQUARE}×{SQUARE} images for a text model: {growth / MB:.1f} MB")  # noqa: T201
    assert growth < API_GROWTH_BOUND, f"the API's peak grew {growth / MB:.0f} MB: it decoded the images"


def test_a_strip_record_is_422_at_submission_naming_it(server: LiveServer) -> None:
    with unchanged(server):
        for model in (RESNET, LLAMA):  # refused from the header, whichever model reads it
            response = post(server.client, "strip", model, [digit_record(0), {"image": b64(strip_png(STRIP))}])
            assert_problem(response, 422, f"record 1: the image is 1×{STRIP}", "over 100 times its shorter")


def test_a_strip_in_an_image_folder_fails_its_job_by_name_cheaply(server: LiveServer, root: Path) -> None:
    folder = root / "datasets" / "strips"
    for label in ("class_0", "class_1"):
        (folder / label).mkdir(parents=True)
        (folder / label / "0000.png").write_bytes(encode(digit_image(0 if label == "class_0" else 1, rgb=True), "PNG"))
    warm = {"name": "digits-folder", "models": [RESNET], "dataset": {"uri": f"file://{folder}"}}
    finished = wait_for_job(server.client, _job(server.client.post("/concepts", json=warm)), timeout=300)
    assert finished["status"] == "succeeded", finished  # the model and its processor loaded, a batch resized
    pid = job_process(server)
    before = reset_peak(pid)
    (folder / "class_1" / "0001.png").write_bytes(strip_png(STRIP))
    body = {"name": "strip-folder", "models": [RESNET], "dataset": {"uri": f"file://{folder}"}}
    failed = wait_for_job(server.client, _job(server.client.post("/concepts", json=body)), timeout=300)
    growth = peak_rss_bytes(pid) - before
    print(f"\njob process peak RSS growth for a 1×{STRIP} strip in an ImageFolder: {growth / MB:.1f} MB")  # noqa: T201
    assert growth < JOB_GROWTH_BOUND, f"the job process's peak grew {growth / MB:.0f} MB resizing the strip"
    assert failed["status"] == "failed", failed
    assert failed["error"]["status"] == 422, failed
    detail = failed["error"]["detail"]
    assert f"dataset file class_1/0001.png: the image is 1×{STRIP}" in detail, detail
    shutil.rmtree(folder)


def _job(response: httpx.Response) -> str:
    assert response.status_code == 202, response.text
    (job,) = response.json()["jobs"]
    return str(job["job_id"])
