"""``/readyz``: ready only when jobs can run. In distributed mode that needs, besides storage and the
broker, a worker with a live heartbeat on every queue (``service.jobs.presence``); a queue nobody
consumes would hold its jobs forever while the API said "ready".

Real processes: a private Redis, the API and ``engram-service worker`` processes (tests.distributed.cluster).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from engram_fixtures.live import REPO_ROOT, LiveServer, kill_worker, server_env
from tests.distributed.cluster import Cluster

# Long enough that a worker stopped cleanly is seen gone well before its entry could have expired.
TTL_S = 15
WORKER_START_TIMEOUT_S = 180  # a worker imports torch and transformers first: slow on a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("readyz")
    (root / "models").mkdir()
    cluster = Cluster(root, ENGRAM_HEARTBEAT_TTL_S=str(TTL_S))
    try:
        yield cluster
    finally:
        cluster.close()


def _worker(cluster: Cluster, queues: str) -> subprocess.Popen[bytes]:
    """``engram-service worker --queues <queues>`` in its own process group (killed by the cluster at the end)."""
    name = f"worker-{len(cluster.workers)}"
    env = server_env(cluster.storage, cluster.models, **cluster.env_for(name))
    with (cluster.root / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "worker", "--queues", queues],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    cluster.workers.append(process)
    return process


def _until(api: LiveServer, done: Callable[[httpx.Response], bool], timeout: float, why: str) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        response = api.client.get("/readyz")
        if done(response):
            return response
        if time.monotonic() > deadline:
            raise AssertionError(f"{why}: /readyz still answers {response.status_code} {response.text}")
        time.sleep(0.25)


def _not_ready_for(queues: set[str]) -> Callable[[httpx.Response], bool]:
    """The 503 whose detail names exactly these queues as lacking a worker."""

    def match(response: httpx.Response) -> bool:
        if response.status_code != 503:
            return False
        found = re.match(r"no live worker consumes queues? ([a-z, ]+): ", response.json()["detail"])
        return found is not None and set(found.group(1).split(", ")) == queues

    return match


def _problem(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/problem+json"), response.headers
    problem = response.json()
    assert problem["status"] == 503 and problem["title"] == "Service unavailable", problem
    return problem


def test_embedded_mode_is_ready_without_workers(live_server: LiveServer) -> None:
    response = live_server.client.get("/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    # job_process: whether the job process has imported the job bodies yet (jobs queue meanwhile).
    assert body == {"status": "ready", "mode": "embedded", "job_process": body.get("job_process")}, body
    assert body["job_process"] in ("starting", "ready")


def test_distributed_mode_is_ready_only_while_every_queue_has_a_live_worker(cluster: Cluster) -> None:
    api = cluster.api

    # No worker at all: storage and Redis answer, but nothing would ever run a job.
    problem = _problem(_until(api, _not_ready_for({"cpu", "gpu"}), 30, "no worker yet"))
    assert "no live worker consumes queues cpu, gpu" in problem["detail"], problem
    assert "engram-service worker" in problem["detail"] and f"ENGRAM_HEARTBEAT_TTL_S={TTL_S}s" in problem["detail"]

    # A worker of the cpu queue only: the gpu queue still has no consumer, and the problem says so.
    cpu_only = _worker(cluster, "cpu")
    problem = _problem(_until(api, _not_ready_for({"gpu"}), WORKER_START_TIMEOUT_S, "a cpu worker started"))
    assert "queue gpu:" in problem["detail"] and "--queues gpu" in problem["detail"], problem

    # A worker of both queues: ready, with how many live workers consume each queue.
    both = _worker(cluster, "gpu,cpu")
    ready = _until(api, lambda r: r.status_code == 200, WORKER_START_TIMEOUT_S, "a gpu,cpu worker started")
    assert ready.json() == {"status": "ready", "mode": "distributed", "workers": {"cpu": 2, "gpu": 1}}

    # Stopped cleanly (SIGTERM: Celery's warm shutdown), a worker withdraws at once, not after its TTL.
    stopped_at = time.monotonic()
    both.send_signal(signal.SIGTERM)
    both.wait(timeout=60)
    _problem(_until(api, _not_ready_for({"gpu"}), TTL_S, "the gpu,cpu worker stopped"))
    assert time.monotonic() - stopped_at < TTL_S, "the entry expired instead of being withdrawn"

    # Killed outright, a worker cannot withdraw: it counts until its heartbeat expires, then not.
    killed_at = time.monotonic()
    kill_worker(cpu_only)  # SIGKILL to its process group
    assert api.client.get("/readyz").json()["detail"].startswith("no live worker consumes queue gpu:")
    problem = _problem(_until(api, _not_ready_for({"cpu", "gpu"}), TTL_S + 10, "the cpu worker was killed"))
    assert time.monotonic() - killed_at <= TTL_S + 10, problem
