"""A variant on S3 is uploaded while it is written (issue 27): its safetensors file goes out part by
part as the writer produces it, and publishing completes that upload instead of uploading the file
again afterwards. A failure in the middle leaves no object and no unfinished multipart upload.

The store is SeaweedFS (signatures checked) with 5 MiB parts; the model is a ~12 MB Llama, so its
checkpoint spans several parts and some are sent before the write ends. The stored bytes are checked
against the digest the writer took of the bytes it wrote (``hashlib`` over the object).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from service.engine import safetensors_stream
from service.storage.s3 import S3Storage, S3StreamedUpload
from service.variants.service import submit_variant
from tests.helpers.s3 import PART, SeaweedServer, s3_storage
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "s3/llama"
SHARDS = {"checkpoint": "model.safetensors", "delta": "delta.safetensors"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedServer, s3_bucket: str) -> StoreWorld:
    root = tmp_path_factory.mktemp("streamed")
    w = StoreWorld(root, storage=s3_storage(seaweed, s3_bucket))
    w.tiny_llama(MODEL, {"forget": text_records(0, 30), "retain": text_records(30, 90)}, hidden=384)
    return w


@pytest.fixture
def uploads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Keys published by a streamed upload's completion, and by a plain ``put_file``, in this test."""
    seen: dict[str, list[str]] = {"streamed": [], "put_file": []}
    complete, put_file = S3StreamedUpload.complete, S3Storage.put_file

    def spy_complete(self: S3StreamedUpload, size: int) -> None:
        complete(self, size)
        seen["streamed"].append(self._key)

    def spy_put_file(self: S3Storage, key: str, source: Path) -> None:
        seen["put_file"].append(key)
        put_file(self, key, source)

    monkeypatch.setattr(S3StreamedUpload, "complete", spy_complete)
    monkeypatch.setattr(S3Storage, "put_file", spy_put_file)
    return seen


_alpha = iter(-0.9 + 0.01 * k for k in range(1000))  # a new alpha each time: never a stored variant


def _submit(w: StoreWorld, fmt: str) -> str:
    options = {"scaling": "uniform", "format": fmt, "reference": ["forget", "retain"]}
    view, job = submit_variant(w.ctx, MODEL, {"forget": next(_alpha)}, None, options)
    assert job is not None, view
    return str(view.variant_id)


def _unfinished_uploads(storage: S3Storage) -> list[str]:
    response = storage.client.list_multipart_uploads(Bucket=storage.bucket, Prefix=storage.prefix)
    return [upload["Key"] for upload in response.get("Uploads", [])]


@pytest.mark.parametrize("fmt", list(SHARDS))
def test_the_safetensors_file_is_uploaded_while_written_and_stored_as_written(
    world: StoreWorld, uploads: dict[str, list[str]], fmt: str
) -> None:
    variant_id = _submit(world, fmt)
    [done] = world.run_pending()
    assert done.status == "succeeded", done
    shard_key = f"variants/{variant_id}/files/{SHARDS[fmt]}"
    assert uploads["streamed"] == [shard_key], "the safetensors file is published by its streamed upload"
    assert shard_key not in uploads["put_file"], "and not uploaded a second time"
    manifest = world.ctx.storage.get_json(f"variants/{variant_id}/manifest.json")
    [entry] = [f for f in manifest["files"] if f["path"] == SHARDS[fmt]]
    data = world.ctx.storage.get_bytes(shard_key)
    assert entry["size"] == len(data) > PART, "several parts"
    assert entry["sha256"] == hashlib.sha256(data).hexdigest(), "the object is exactly the bytes written"
    storage = world.ctx.storage
    assert isinstance(storage, S3Storage)
    assert _unfinished_uploads(storage) == []


def test_a_write_that_fails_after_parts_were_sent_leaves_nothing(world: StoreWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    variant_id = _submit(world, "checkpoint")
    original, told = safetensors_stream._write_all, [0]

    def fail_past_two_parts(out: BinaryIO, data: bytes | memoryview, sink: Any = None) -> None:
        view = memoryview(data).cast("B")
        told[0] += view.nbytes
        original(out, view, sink)
        if told[0] > 2 * PART:  # a part was cut and sent already
            raise OSError("the disk went away mid-write")

    monkeypatch.setattr(safetensors_stream, "_write_all", fail_past_two_parts)
    [done] = world.run_pending()
    assert done.status == "failed", done
    # what was asked stays (the request and its provenance); nothing of the variant
    asked = [f"variants/{variant_id}/{name}" for name in ("provenance.json", "request.json")]
    assert world.ctx.storage.list(f"variants/{variant_id}/") == asked
    storage = world.ctx.storage
    assert isinstance(storage, S3Storage)
    assert _unfinished_uploads(storage) == [], "the multipart upload was aborted"
