"""Distributed mode: a collection stuck where no cancellation check runs is still cancelled
(issue 23, finding 8). The worker's watchdog ends its pool process ENGRAM_CANCEL_GRACE_S after the
DELETE; the task is ``reject_on_worker_lost``, so its message comes back and the job is marked
cancelled, and the worker's fresh pool process takes the next collection.

What cannot be produced here on purpose, a native call lasting minutes, is stood in for by the
test-only ``sitecustomize`` of ``tests/api/stalling_tokenizer`` in the worker (it sleeps inside the
record cut for one marked record); Redis, the API and the Celery worker are real processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.live import REPO_ROOT, wait_concepts_ready, wait_for_job
from engram_fixtures.models import make_tiny_llama
from tests.distributed.cluster import Cluster

INJECTOR = Path(__file__).parents[1] / "api" / "stalling_tokenizer"
MODEL = "stuck/tiny"
GRACE_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("dist-stuck")
    make_tiny_llama(root / "models" / "tiny", hidden=32, layers=2)
    cluster = Cluster(root, PYTHONPATH=f"{INJECTOR}:{REPO_ROOT}", ENGRAM_CANCEL_GRACE_S=str(GRACE_S))
    try:
        cluster.start_worker()
        client = cluster.api.client
        response = client.post("/models", json={"model_id": MODEL, "source": f"file://{root / 'models' / 'tiny'}"})
        assert response.status_code == 201, response.text
        yield cluster
    finally:
        cluster.close()


def post(api: httpx.Client, name: str, text: str) -> dict[str, Any]:
    response = api.post("/concepts", json={"name": name, "models": [MODEL], "records": [{"text": text}]})
    assert response.status_code == 202, response.text
    [job] = response.json()["jobs"]
    return dict(job)


def test_a_collection_stuck_in_native_code_is_cancelled_and_the_worker_goes_on(cluster: Cluster) -> None:
    api = cluster.api.client
    job = post(api, "stuck", "STALL-IN-NATIVE-CODE and then some words")
    deadline = time.monotonic() + 120
    while api.get(f"/jobs/{job['job_id']}").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)
    asked = time.monotonic()
    assert api.delete(f"/jobs/{job['job_id']}").status_code == 200
    final = wait_for_job(api, job["job_id"], timeout=60)
    latency = time.monotonic() - asked
    print(f"\ndistributed, stuck in native code: cancelled {latency:.2f}s after DELETE (grace {GRACE_S}s)")  # noqa: T201
    assert final["status"] == "cancelled", final
    assert latency < GRACE_S + 15
    post(api, "after-the-stall", "the worker's fresh pool process takes the next collection")
    wait_concepts_ready(api, ["after-the-stall"], timeout=120)
