"""Distributed mode against real processes: a private redis-server, Celery workers and the API.

Storage here is the local file backend shared by API and workers; the S3 variants of these
scenarios live in ``test_distributed_s3.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.demo import make_facts
from engram_fixtures.live import (
    kill_worker,
    wait_for_job,
)
from engram_fixtures.models import make_tiny_llama
from service.engine.checkpoint import inspect_model_dir
from service.engine.collect import collect_statistics
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from service.engine.stats_io import load_statistics
from tests.distributed.cluster import Cluster

MODEL = "dist/tiny"
FACTS = make_facts(60, seed=11)
# Long enough that a collection at batch size 1 runs for several seconds: room to kill a worker.
LONG_RECORDS = [{"text": " ".join(p + c for p, c in FACTS[i : i + 6])} for i in range(0, 54)] * 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("dist")
    make_tiny_llama(root / "models" / "tiny", hidden=32, layers=2)
    cluster = Cluster(root)
    try:
        cluster.start_worker()
        client = cluster.api.client
        response = client.post("/models", json={"model_id": MODEL, "source": f"file://{root / 'models' / 'tiny'}"})
        assert response.status_code == 201, response.text
        yield cluster
    finally:
        cluster.close()


def post_concept(client: httpx.Client, name: str, records: list[dict[str, str]]) -> dict[str, Any]:
    response = client.post("/concepts", json={"name": name, "models": [MODEL], "records": records})
    assert response.status_code == 202, response.text
    return response.json()


def reference_statistics(model_dir: Path, records: list[dict[str, str]]) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = [encode_record(tokenizer, Record.from_mapping(r, i), 512) for i, r in enumerate(records)]
    return collect_statistics(model, make_batches(examples, 8, pad_token_id(tokenizer)), inspect_model_dir(model_dir).layers)


def stored_statistics(cluster: Cluster, job: dict[str, Any]) -> Any:
    return load_statistics(cluster.storage / job["result"]["stats"] / "statistics.safetensors")


def assert_same_statistics(ours: Any, reference: Any) -> None:
    assert ours.layer_group == reference.layer_group
    for group, sigma in reference.sums.items():
        assert ours.counts[group] == reference.counts[group]
        # batch size 1 (worker) vs 8 (reference): float32 products differ in rounding only
        assert float((ours.sums[group] - sigma).norm() / sigma.norm()) < 1e-6, group


def test_flow_runs_in_the_worker_not_the_api(cluster: Cluster) -> None:
    client = cluster.api.client
    forget = post_concept(client, "d-forget", [{"prompt": p, "completion": c} for p, c in FACTS[:6]])
    retain = post_concept(client, "d-retain", [{"prompt": p, "completion": c} for p, c in FACTS[6:30]])
    jobs = [wait_for_job(client, s["jobs"][0]["job_id"]) for s in (forget, retain)]
    assert [j["status"] for j in jobs] == ["succeeded", "succeeded"]
    worker_pids = {j["result"]["worker"].rsplit(":", 1)[1] for j in jobs}
    assert str(cluster.api.process.pid) not in worker_pids, "collection must run in a worker"

    submitted = client.post(f"/models/{MODEL}/unlearn", json={"concepts": ["d-forget"]})
    assert submitted.status_code == 202, submitted.text
    built = wait_for_job(client, submitted.json()["job"]["job_id"])
    assert built["status"] == "succeeded", built
    assert built["result"]["worker"].rsplit(":", 1)[1] != str(cluster.api.process.pid)
    variant = client.get(f"/variants/{built['result']['variant_id']}").json()
    assert variant["status"] == "ready"
    records = [{"prompt": p, "completion": c} for p, c in FACTS[:6]]
    assert_same_statistics(stored_statistics(cluster, jobs[0]), reference_statistics(cluster.models / "tiny", records))

    # Evaluation and generation run the model: in a worker (gpu queue), not in the API.
    for route, body in (("evaluate", {"forget": records[:3]}), ("generate", {"prompt": records[0]["prompt"]})):
        answer = client.post(f"/variants/{variant['variant_id']}/{route}", params={"wait": 30}, json=body)
        assert answer.status_code in (200, 202), answer.text
        job = wait_for_job(client, answer.json()["job_id"])
        assert job["status"] == "succeeded", job
        assert job["result"]["worker"].rsplit(":", 1)[1] != str(cluster.api.process.pid)
    assert job["result"]["outputs"]["variant"]["token_ids"]


def test_identical_concurrent_posts_run_one_collection(cluster: Cluster) -> None:
    client = cluster.api.client
    records = [{"text": p + c} for p, c in FACTS[30:40]]
    answers: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=cluster.api.base_url, timeout=60) as own:
            answers.append(own.post("/concepts", json={"name": "twins", "models": [MODEL], "records": records}))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [a.status_code for a in answers] == [202] * 6
    job_ids = {a.json()["jobs"][0]["job_id"] for a in answers}
    assert len(job_ids) == 1, job_ids
    assert wait_for_job(client, job_ids.pop())["status"] == "succeeded"
    collect_jobs = [
        j
        for j in (json.loads(p.read_text()) for p in (cluster.storage / "jobs").glob("*.json"))
        if j["kind"] == "collect" and j["payload"]["concept"] == "twins"
    ]
    assert len(collect_jobs) == 1


def test_identical_concurrent_variant_requests_build_once(cluster: Cluster) -> None:
    client = cluster.api.client
    for name, lo, hi in (("v-forget", 50, 54), ("v-retain", 54, 60)):
        wait_for_job(client, post_concept(client, name, [{"text": p + c} for p, c in FACTS[lo:hi]])["jobs"][0]["job_id"])
    request = {"concepts": ["v-forget"], "reference": ["v-retain"], "alpha": 0.7, "format": "delta"}
    answers: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=cluster.api.base_url, timeout=60) as own:
            answers.append(own.post(f"/models/{MODEL}/unlearn", json=request))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {a.status_code for a in answers} <= {200, 202}
    variant_ids = {a.json()["variant"]["variant_id"] for a in answers}
    job_ids = {a.json()["variant"]["job_id"] for a in answers}
    assert len(variant_ids) == 1
    assert len(job_ids) == 1, job_ids
    assert wait_for_job(client, job_ids.pop())["status"] == "succeeded"


def test_a_worker_builds_a_universe_and_the_next_variant_only_reads_it(cluster: Cluster) -> None:
    client = cluster.api.client
    for name, lo, hi in (("u-forget", 40, 44), ("u-retain", 44, 50)):
        wait_for_job(client, post_concept(client, name, [{"text": p + c} for p, c in FACTS[lo:hi]])["jobs"][0]["job_id"])
    response = client.post(f"/models/{MODEL}/universes", json={"concepts": ["u-forget", "u-retain"], "rcond": 1e-3})
    assert response.status_code == 202, response.text
    job = wait_for_job(client, response.json()["job"]["job_id"])
    assert job["status"] == "succeeded" and job["kind"] == "universe", job
    universe = client.get(f"/universes/{response.json()['universe']['universe_id']}").json()
    assert universe["status"] == "ready" and universe["current"] is True and universe["rcond"] == 1e-3
    variant = client.post(f"/models/{MODEL}/unlearn", json={"concepts": ["u-forget"]})
    assert variant.status_code == 202, variant.text
    assert variant.json()["variant"]["universe_id"] == universe["universe_id"], "the current universe"
    built = wait_for_job(client, variant.json()["job"]["job_id"])
    assert built["status"] == "succeeded" and built["result"]["universe_built_s"] is None, built


def test_worker_killed_mid_collection_is_recovered(cluster: Cluster) -> None:
    client = cluster.api.client
    submitted = post_concept(client, "long", LONG_RECORDS)
    job_id = submitted["jobs"][0]["job_id"]
    partial_seen = watch_for_partial_artifacts(cluster.storage)
    deadline = time.monotonic() + 120
    while True:  # wait until the worker is inside the collection
        job = client.get(f"/jobs/{job_id}").json()
        if job["status"] == "running" and job["progress"]["done"] > 0:
            break
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["progress"]["done"] < job["progress"]["total"], "the collection finished before the kill"
    kill_worker(cluster.workers[0])
    killed_at = time.monotonic()
    cluster.start_worker()
    final = wait_for_job(client, job_id, timeout=240)
    recovery_s = time.monotonic() - killed_at
    assert final["status"] == "succeeded", final
    print(f"\nworker SIGKILLed mid-collection: recovered in {recovery_s:.1f}s")  # noqa: T201 - note figure
    assert_same_statistics(stored_statistics(cluster, final), reference_statistics(cluster.models / "tiny", LONG_RECORDS))
    partial_seen.stop()
    assert partial_seen.problems == []


def test_redis_restart_loses_nothing(cluster: Cluster) -> None:
    client = cluster.api.client
    before = {path: client.get(path).json() for path in ("/models", "/concepts", f"/models/{MODEL}/variants")}
    some_job = next(iter(before["/concepts"]))["models"][MODEL]["job_id"]
    cluster.restart_redis()
    for path, body in before.items():
        assert client.get(path).json() == body, path
    assert client.get(f"/jobs/{some_job}").json()["status"] == "succeeded"
    # And the restarted broker takes new work: a new concept collects.
    fresh = post_concept(client, "after-restart", [{"text": p + c} for p, c in FACTS[40:44]])
    assert wait_for_job(client, fresh["jobs"][0]["job_id"], timeout=120)["status"] == "succeeded"


def test_job_lost_with_redis_is_dispatched_again(cluster: Cluster) -> None:
    """A queued job whose message dies with Redis is found by the reconciler and still runs."""
    client = cluster.api.client
    for worker in cluster.workers:
        kill_worker(worker)
    submitted = post_concept(client, "orphan", [{"text": p + c} for p, c in FACTS[44:50]])
    job_id = submitted["jobs"][0]["job_id"]
    cluster.restart_redis()  # the queued message and the live job record are gone
    cluster.start_worker()
    assert wait_for_job(client, job_id, timeout=120)["status"] == "succeeded"


class watch_for_partial_artifacts:  # noqa: N801 - used like a function
    """Polls storage in a thread: a statistics manifest must never appear without its whole file."""

    def __init__(self, storage: Path) -> None:
        self.storage, self.problems = storage, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for manifest in (self.storage / "stats").rglob("manifest.json") if (self.storage / "stats").exists() else []:
                stats = manifest.parent / "statistics.safetensors"
                try:
                    load_statistics(stats)
                except Exception as exc:
                    self.problems.append(f"{manifest}: {exc}")
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
