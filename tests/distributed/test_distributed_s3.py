"""Distributed mode on S3 (SeaweedFS, signatures checked): the mini-TOFU flow with the model
registered from the bucket, and an S3 outage that the API reports as 503 and the job survives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import kill_worker, wait_for_job
from tests.distributed.cluster import Cluster
from tests.e2e.tofu import run_mini_tofu
from tests.helpers.api import register_model
from tests.helpers.s3 import SeaweedServer, drop_bucket, restart_seaweed, stop_seaweed

PREFIX = "engram"
MODELS = "dist-s3-models"  # s3:// models come from this bucket: never the store's own (ENGRAM_MODEL_BUCKETS)


def bucket_keys(seaweed: SeaweedServer, bucket: str, prefix: str) -> list[str]:
    pages = seaweed.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def upload_dir(seaweed: SeaweedServer, bucket: str, local: Path, prefix: str) -> None:
    client = seaweed.client()
    for file in sorted(p for p in local.iterdir() if p.is_file()):
        client.upload_file(str(file), bucket, f"{prefix}/{file.name}")


@pytest.fixture(scope="module")
def s3_cluster(seaweed: SeaweedServer, s3_bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("dist-s3")
    (root / "models").mkdir()
    storage = {"ENGRAM_STORAGE_URL": f"s3://{s3_bucket}/{PREFIX}", "ENGRAM_S3_ENDPOINT_URL": seaweed.endpoint_url}
    seaweed.client().create_bucket(Bucket=MODELS)
    cluster = Cluster(root, **storage, ENGRAM_MODEL_BUCKETS=MODELS, **seaweed.env())
    try:
        cluster.start_worker()
        yield cluster
    finally:
        cluster.close()
        drop_bucket(seaweed, MODELS)


def test_mini_tofu_in_distributed_mode_on_s3(
    s3_cluster: Cluster, seaweed: SeaweedServer, s3_bucket: str, mini_tofu_demo: Path, tmp_path: Path
) -> None:
    upload_dir(seaweed, MODELS, mini_tofu_demo / "demo" / "model", "models/mini-tofu")
    source = f"s3://{MODELS}/models/mini-tofu/"
    result = run_mini_tofu(s3_cluster.api.client, mini_tofu_demo, source, tmp_path, model_id="dist/mini-tofu")

    api_pid = str(s3_cluster.api.process.pid)
    assert all(job["result"]["worker"].rsplit(":", 1)[1] != api_pid for job in result["jobs"]), "work ran in the API"
    keys = bucket_keys(seaweed, s3_bucket, PREFIX + "/")
    for job in result["jobs"][:2]:
        assert f"{PREFIX}/{job['result']['stats']}statistics.safetensors" in keys
        assert f"{PREFIX}/{job['result']['stats']}manifest.json" in keys
    variant_id = result["variant"]["variant_id"]
    assert f"{PREFIX}/variants/{variant_id}/manifest.json" in keys
    assert f"{PREFIX}/variants/{variant_id}/files/model.safetensors" in keys
    # The worker fetched the model from the bucket into its own cache, not the API's.
    assert any((s3_cluster.root / "cache" / "worker-0" / "s3").iterdir())


def test_s3_outage_is_503_and_the_job_survives_it(s3_cluster: Cluster, seaweed: SeaweedServer) -> None:
    client = s3_cluster.api.client
    tiny = s3_cluster.models / "tiny"
    if not tiny.exists():
        from engram_fixtures.models import make_tiny_llama

        make_tiny_llama(tiny, hidden=32, layers=2)
    register_model(client, "s3/tiny", f"file://{tiny}")
    for worker in s3_cluster.workers:  # hold the job in the queue until S3 is down
        kill_worker(worker)
    facts = make_facts(12, seed=5)
    body = {"name": "outage", "models": ["s3/tiny"], "records": [{"text": p + c} for p, c in facts]}
    submitted = client.post("/concepts", json=body)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["jobs"][0]["job_id"]

    stop_seaweed(seaweed)
    down_at = time.monotonic()
    try:
        for path in ("/models", "/concepts/outage", "/readyz"):
            response = client.get(path)
            assert response.status_code == 503, (path, response.text)
            assert response.headers["content-type"].startswith("application/problem+json")
            if path != "/readyz":  # a probe, not a request to retry
                assert int(response.headers["retry-after"]) > 0, response.headers
        refused = client.post("/concepts", json={**body, "name": "during-outage"})
        assert refused.status_code == 503, refused.text
        s3_cluster.start_worker()  # it takes the job, fails to reach S3, and retries with backoff
        _wait_for_retry(s3_cluster, job_id)
    finally:
        restart_seaweed(seaweed)
    final = wait_for_job(client, job_id, timeout=180)
    print(f"\nS3 down for {time.monotonic() - down_at:.1f}s; job {final['status']}")  # noqa: T201
    assert final["status"] == "succeeded", final
    assert client.get("/concepts/outage").json()["models"]["s3/tiny"]["status"] == "ready"
    assert client.get("/concepts/during-outage").status_code == 404, "a refused request stored nothing"


def _wait_for_retry(cluster: Cluster, job_id: str, timeout: float = 60) -> None:
    """Until the worker log shows the job's task being retried (it saw S3 down)."""
    deadline = time.monotonic() + timeout
    log = cluster.root / f"worker-{len(cluster.workers) - 1}.log"
    while time.monotonic() < deadline:
        if log.exists() and "retry" in log.read_text(errors="replace").lower():
            return
        time.sleep(0.2)
    raise AssertionError(f"the worker never retried job {job_id}: {log.read_text(errors='replace')[-2000:]}")
