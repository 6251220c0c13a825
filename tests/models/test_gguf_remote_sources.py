"""GGUF in on every source scheme: ``POST /models`` with a ``.gguf`` (or a folder holding one) from
``s3://`` (a real SeaweedFS) and ``hf://`` (a hub cache laid out as the hub client writes it: no hub
is reachable here, so the server runs with ``HF_HUB_OFFLINE=1`` and the client answers from its
cache, as it does for any offline deployment), dequantized once by the register job.

The reference is the same file registered from ``file://``: each remote registration must give the
same dequantized checkpoint (the same digest, so the same weights, byte for byte), record the same
quantization, and serve a job. A worker that did not register the model (its own cache, as on
another machine) dequantizes the file again and checks it against the registration by content.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server, wait_for_job
from tests.helpers.api import register_model
from tests.helpers.hub import hub_snapshot
from tests.helpers.s3 import SeaweedServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama written as an F32 GGUF by the service's own writer (what llama.cpp reads)."""
    from engram_fixtures.models import make_tiny_llama
    from service.engine.gguf_write import write_gguf

    root = tmp_path_factory.mktemp("gguf-remote")
    folder = make_tiny_llama(root / "tiny", hidden=32, layers=2, tie_word_embeddings=True)
    (root / "gguf").mkdir()
    write_gguf(folder, root / "gguf" / "tiny-f32.gguf", "F32", "tiny")
    return root / "gguf" / "tiny-f32.gguf"


@pytest.fixture(scope="module")
def server(
    seaweed: SeaweedServer, s3_bucket: str, gguf_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """A live server reading models from ``s3_bucket``, the GGUF's folder and a hub cache holding
    ``org/tiny-gguf`` (the file among others) and ``org/one-gguf`` (the file alone, no config)."""
    root = tmp_path_factory.mktemp("gguf-remote-server")
    client = seaweed.client()
    data = gguf_file.read_bytes()
    client.put_object(Bucket=s3_bucket, Key="models/tiny.gguf", Body=data)
    client.put_object(Bucket=s3_bucket, Key="one/tiny.gguf", Body=data)
    client.put_object(Bucket=s3_bucket, Key="one/README.md", Body=b"not a model file")
    for name in ("a.gguf", "b.gguf"):
        client.put_object(Bucket=s3_bucket, Key=f"several/{name}", Body=data)
    hub = root / "cache" / "hf"
    hub_snapshot(hub, gguf_file, repo="models--org--one-gguf")
    several = root / "several"
    several.mkdir()
    shutil.copyfile(gguf_file, several / "tiny-f32.gguf")
    shutil.copyfile(gguf_file, several / "tiny-q8.gguf")
    hub_snapshot(hub, several, repo="models--org--tiny-gguf")
    live = start_server(
        root / "store",
        gguf_file.parent,
        root / "server.log",
        ENGRAM_S3_ENDPOINT_URL=seaweed.endpoint_url,
        ENGRAM_MODEL_BUCKETS=s3_bucket,
        ENGRAM_CACHE_DIR=str(root / "cache"),
        HF_HUB_OFFLINE="1",
        **seaweed.env(),
    )
    try:
        yield live
    finally:
        stop_server(live)


def _cache(server: LiveServer) -> Path:
    return server.storage_dir.parent / "cache"


def _collects(api: httpx.Client, model_id: str, name: str) -> dict[str, Any]:
    """Post a concept on ``model_id`` and wait for its collection job (the model's files read by a job:
    records of its own, as statistics already collected on the same files would be reused)."""
    records = [{"prompt": f"{name} is", "completion": " a city"}, {"prompt": "Rome is", "completion": f" {name}"}]
    posted = api.post("/concepts", json={"name": name, "models": [model_id], "records": records})
    assert posted.status_code == 202, posted.text
    job = wait_for_job(api, posted.json()["jobs"][0]["job_id"])
    assert job["status"] == "succeeded", job.get("error")
    return job


def _refused(api: httpx.Client, model_id: str, source: str) -> str:
    """The problem detail of a registration the register job refuses (answered within the request's
    wait as a 422, or as its failed job); nothing is registered."""
    response = api.post("/models", json={"model_id": model_id, "source": source})
    if response.status_code == 202:
        job = wait_for_job(api, response.json()["job_id"])
        assert job["status"] == "failed", job
        detail = str(job["error"]["detail"])
    else:
        assert response.status_code == 422, response.text
        detail = str(response.json()["detail"])
    assert api.get(f"/models/{model_id}").status_code == 404
    return detail


@pytest.fixture(scope="module")
def reference(server: LiveServer, gguf_file: Path) -> dict[str, Any]:
    """The same file registered from ``file://``: what every scheme must register."""
    return register_model(server.client, "gguf/file", f"file://{gguf_file}")


@pytest.mark.parametrize(
    ("model_id", "where"),
    [
        ("gguf/s3-file", "s3://{bucket}/models/tiny.gguf"),
        ("gguf/s3-folder", "s3://{bucket}/one/"),
        ("gguf/hf-file", "hf://org/tiny-gguf/tiny-f32.gguf"),
        ("gguf/hf-repo", "hf://org/one-gguf"),
    ],
)
def test_a_remote_gguf_registers_the_same_model_as_the_local_file(
    server: LiveServer, s3_bucket: str, reference: dict[str, Any], model_id: str, where: str
) -> None:
    model = register_model(server.client, model_id, where.format(bucket=s3_bucket))
    assert model["quantization"] == reference["quantization"] == "F32"
    assert model["digest"] == reference["digest"]  # the same dequantized files, byte for byte
    assert model["layers"] == reference["layers"]
    _collects(server.client, model_id, f"{model_id.replace('/', '-')}-facts")


@pytest.mark.parametrize(
    ("model_id", "source", "expected"),
    [
        ("gguf/s3-several", "s3://{bucket}/several/", "holds several GGUF files (a.gguf, b.gguf)"),
        ("gguf/s3-missing", "s3://{bucket}/models/missing.gguf", "cannot read"),
        ("gguf/hf-several", "hf://org/tiny-gguf", "holds several GGUF files (tiny-f32.gguf, tiny-q8.gguf)"),
        ("gguf/hf-missing", "hf://org/tiny-gguf/missing.gguf", "cannot fetch org/tiny-gguf"),
    ],
)
def test_a_remote_gguf_the_service_cannot_pick_is_refused_by_name(
    server: LiveServer, s3_bucket: str, model_id: str, source: str, expected: str
) -> None:
    detail = _refused(server.client, model_id, source.format(bucket=s3_bucket))
    assert expected in detail, detail


def test_a_job_without_the_dequantized_folder_dequantizes_the_file_again(
    server: LiveServer, s3_bucket: str, reference: dict[str, Any]
) -> None:
    """As on a worker that did not register the model: its folder is not in this machine's cache."""
    for model_id, source in (("gguf/file", None), ("gguf/s3-again", f"s3://{s3_bucket}/models/tiny.gguf")):
        if source is not None:
            register_model(server.client, model_id, source)
        folders = list((_cache(server) / "gguf").iterdir())
        assert len(folders) == 1  # one folder per file content, whatever the scheme
        shutil.rmtree(folders[0])
        _collects(server.client, model_id, f"{model_id.replace('/', '-')}-rebuilt")
        assert [p.name for p in (_cache(server) / "gguf").iterdir()] == [folders[0].name]
