"""The API with ``ENGRAM_STORAGE_URL=s3://...``: the real server process on a real SeaweedFS.

One happy path (register, collect two concepts, unlearn, download with Range) checked end to end in
the bucket, then the same storage served by a second server with presigned downloads (307 to S3).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, start_server, stop_server, wait_concepts_ready, wait_for_job, wait_variant_ready
from tests.helpers.api import assert_problem
from tests.helpers.s3 import SeaweedServer, drop_bucket

pytestmark = pytest.mark.slow

PREFIX = "engram"  # the server's keys live under s3://<bucket>/engram/
MODELS = "api-on-s3-models"  # s3:// models come from this bucket: never the store's own (ENGRAM_MODEL_BUCKETS)
FACTS = make_facts(20, seed=0)
FORGET = [{"prompt": p, "completion": c} for p, c in FACTS[:4]]
RETAIN = [{"prompt": p, "completion": c} for p, c in FACTS[4:12]]


def bucket_keys(seaweed: SeaweedServer, bucket: str, prefix: str) -> list[str]:
    """Every key under ``prefix`` in the bucket, read with a client of the test's own."""
    pages = seaweed.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def start_s3_server(seaweed: SeaweedServer, bucket: str, root: Path, name: str, **env: str) -> LiveServer:
    """The real server on ``s3://bucket/engram``, s3:// models from :data:`MODELS` (ENGRAM_MODEL_BUCKETS);
    its (unused) file storage dir and $HOME are under ``root``."""
    home = root / "home"
    home.mkdir(exist_ok=True)
    return start_server(
        root / f"{name}-file-store",
        root / "models",
        root / f"{name}.log",
        ENGRAM_STORAGE_URL=f"s3://{bucket}/{PREFIX}",
        ENGRAM_S3_ENDPOINT_URL=seaweed.endpoint_url,
        HOME=str(home),  # s3:// model sources are cached under ~/.cache: keep the developer's clean
        ENGRAM_MODEL_BUCKETS=MODELS,
        **seaweed.env(),
        **env,
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's files: ``models/`` (the model root) and the server logs."""
    from engram_fixtures.models import make_tiny_llama

    path = tmp_path_factory.mktemp("api-on-s3")
    make_tiny_llama(path / "models" / "tiny", hidden=32, layers=2, tie_word_embeddings=True)
    return path


@pytest.fixture(scope="module")
def models_bucket(seaweed: SeaweedServer) -> Iterator[str]:
    seaweed.client().create_bucket(Bucket=MODELS)
    try:
        yield MODELS
    finally:
        drop_bucket(seaweed, MODELS)


@pytest.fixture(scope="module")
def server(seaweed: SeaweedServer, s3_bucket: str, models_bucket: str, root: Path) -> Iterator[LiveServer]:
    live = start_s3_server(seaweed, s3_bucket, root, "main")
    try:
        yield live
    finally:
        stop_server(live)


@pytest.fixture(scope="module")
def flow(server: LiveServer, seaweed: SeaweedServer, models_bucket: str, root: Path) -> dict[str, Any]:
    """``org/tiny`` (file://) and ``org/tiny-s3`` (s3://) registered, two concepts ready, one variant ready."""
    api = server.client
    model_dir = root / "models" / "tiny"
    client = seaweed.client()
    for path in sorted(model_dir.iterdir()):
        client.put_object(Bucket=models_bucket, Key=f"sources/tiny/{path.name}", Body=path.read_bytes())
    registered = {}
    for model_id, source in (("org/tiny", f"file://{model_dir}"), ("org/tiny-s3", f"s3://{models_bucket}/sources/tiny/")):
        response = api.post("/models", json={"model_id": model_id, "source": source})
        assert response.status_code == 201, response.text
        registered[model_id] = response.json()
    for name, records, role in (("forget", FORGET, "target"), ("retain", RETAIN, "reference")):
        response = api.post("/concepts", json={"name": name, "models": ["org/tiny"], "records": records, "role": role})
        assert response.status_code == 202, response.text
    concepts = wait_concepts_ready(api, ["forget", "retain"], "org/tiny")
    response = api.post("/models/org/tiny/unlearn", json={"concepts": ["forget"], "reference": ["forget", "retain"]})
    assert response.status_code == 202, response.text
    variant = wait_variant_ready(api, response.json()["variant"]["variant_id"])
    return {"models": registered, "concepts": concepts, "variant": variant}


def test_state_lives_in_the_bucket(server: LiveServer, flow: dict[str, Any], seaweed: SeaweedServer, s3_bucket: str) -> None:
    assert server.client.get("/readyz").status_code == 200
    assert not server.storage_dir.exists() or not any(server.storage_dir.rglob("*"))  # nothing on local disk
    keys = bucket_keys(seaweed, s3_bucket, f"{PREFIX}/")
    vid = flow["variant"]["variant_id"]
    expected = [
        f"{PREFIX}/models/{quote('org/tiny', safe='')}.json",
        f"{PREFIX}/models/{quote('org/tiny-s3', safe='')}.json",
        f"{PREFIX}/concepts/forget.json",
        f"{PREFIX}/variants/{vid}/manifest.json",
        *(f"{PREFIX}/variants/{vid}/files/{f['path']}" for f in flow["variant"]["files"]),
    ]
    assert set(expected) <= set(keys), sorted(set(expected) - set(keys))
    stats_manifests = [k for k in keys if k.startswith(f"{PREFIX}/stats/") and k.endswith("/manifest.json")]
    assert len(stats_manifests) == 2  # one statistic per concept
    assert all(k.startswith(f"{PREFIX}/") or k.startswith("sources/") for k in bucket_keys(seaweed, s3_bucket, ""))


def test_s3_model_source_matches_the_file_source(flow: dict[str, Any]) -> None:
    by_file, by_s3 = flow["models"]["org/tiny"], flow["models"]["org/tiny-s3"]
    assert by_s3["digest"] == by_file["digest"]  # the same bytes, fetched from the bucket
    assert by_s3["layers"] == by_file["layers"]


def test_download_with_range(server: LiveServer, flow: dict[str, Any]) -> None:
    api, variant = server.client, flow["variant"]
    vid = variant["variant_id"]
    for entry in variant["files"]:
        response = api.get(f"/variants/{vid}/files/{entry['path']}")
        assert response.status_code == 200, response.text
        assert hashlib.sha256(response.content).hexdigest() == entry["sha256"]
    size = next(f["size"] for f in variant["files"] if f["path"] == "model.safetensors")
    full = api.get(f"/variants/{vid}/files/model.safetensors").content
    part = api.get(f"/variants/{vid}/files/model.safetensors", headers={"Range": "bytes=100-1123"})
    assert part.status_code == 206, part.text
    assert part.content == full[100:1124]
    assert part.headers["content-range"] == f"bytes 100-1123/{size}"


def test_presigned_downloads_redirect_to_s3(
    flow: dict[str, Any], seaweed: SeaweedServer, s3_bucket: str, root: Path
) -> None:
    """A second server on the same bucket with ENGRAM_PRESIGN_DOWNLOADS: a 307 to a URL S3 serves."""
    live = start_s3_server(seaweed, s3_bucket, root, "presign", ENGRAM_PRESIGN_DOWNLOADS="true")
    try:
        vid = flow["variant"]["variant_id"]
        entry = next(f for f in flow["variant"]["files"] if f["path"] == "model.safetensors")
        response = live.client.get(f"/variants/{vid}/files/model.safetensors")
        assert response.status_code == 307, response.text
        location = response.headers["location"]
        assert location.startswith(f"{seaweed.endpoint_url}/{s3_bucket}/{PREFIX}/variants/{vid}/files/model.safetensors?")
        assert "X-Amz-Signature=" in location
        body = httpx.get(location).content
        assert hashlib.sha256(body).hexdigest() == entry["sha256"]
        ranged = live.client.get(
            f"/variants/{vid}/files/model.safetensors", headers={"Range": "bytes=0-9"}, follow_redirects=True
        )
        assert ranged.status_code == 206
        assert ranged.content == body[:10]
        assert live.client.get(f"/variants/{vid}/files/nope.bin").status_code == 404  # still checked first
    finally:
        stop_server(live)


def test_an_s3_source_is_registered_by_a_job_not_in_the_request(
    server: LiveServer, flow: dict[str, Any], seaweed: SeaweedServer, models_bucket: str, root: Path
) -> None:
    """The download and the digest run in a ``register`` job: 202 with it, then the model as from a folder."""
    api = server.client
    client = seaweed.client()
    for path in sorted((root / "models" / "tiny").iterdir()):
        client.put_object(Bucket=models_bucket, Key=f"sources/tiny-job/{path.name}", Body=path.read_bytes())
    body = {"model_id": "org/tiny-job", "source": f"s3://{models_bucket}/sources/tiny-job/"}
    submitted = api.post("/models", params={"wait": 0}, json=body)
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()
    assert job["kind"] == "register" and job["model_id"] == "org/tiny-job"
    assert submitted.headers["location"] == f"/jobs/{job['job_id']}"
    done = wait_for_job(api, job["job_id"], timeout=60)
    assert done["status"] == "succeeded", done
    model = api.get("/models/org/tiny-job")
    assert model.status_code == 200 and model.json()["digest"] == flow["models"]["org/tiny"]["digest"]
    again = api.post("/models", json=body)
    assert again.status_code == 200 and again.json() == model.json()  # the same registration: no job
    other = api.post("/models", json={**body, "source": f"s3://{models_bucket}/sources/tiny/"})
    assert_problem(other, 409, "already registered")


def test_an_unreadable_s3_source_fails_its_job_and_registers_nothing(server: LiveServer, models_bucket: str) -> None:
    api = server.client
    body = {"model_id": "org/nothing", "source": f"s3://{models_bucket}/sources/nothing-here/"}
    refused = api.post("/models", params={"wait": 30}, json=body)
    assert_problem(refused, 422, "holds no model files")
    job = api.get(f"/jobs/{refused.json()['job_id']}").json()
    assert job["kind"] == "register" and job["status"] == "failed"
    assert api.get("/models/org/nothing").status_code == 404
    assert_problem(api.post("/models", json={"model_id": "org/bad", "source": "s3:///no-bucket/"}), 422)


@pytest.mark.parametrize("inside", [f"{PREFIX}/", f"{PREFIX}/variants/", f"{PREFIX}/stats/some/", "sources/"])
def test_a_model_inside_the_services_own_store_is_refused(
    server: LiveServer, flow: dict[str, Any], s3_bucket: str, inside: str
) -> None:
    """Issue 23: the store's objects (statistics, engrams, other users' variants) never become a model
    anyone may read back; nor does the rest of the store's bucket (issue 35: ENGRAM_MODEL_BUCKETS never holds it)."""
    api = server.client
    body = {"model_id": "org/from-the-store", "source": f"s3://{s3_bucket}/{inside}"}
    refused = api.post("/models", params={"wait": 0}, json=body)
    assert_problem(refused, 422, "ENGRAM_STORAGE_URL")
    assert api.get("/models/org/from-the-store").status_code == 404
    assert not [j for j in api.get("/jobs").json() if j.get("model_id") == "org/from-the-store"], "no job started"
