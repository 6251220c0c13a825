"""Admission control (issue 23, finding 5): a bound on unfinished jobs per API key and in total.

A red team's one write key had 1,600 distinct collections accepted. Here the bounds are tiny
(``ENGRAM_MAX_QUEUED_JOBS_PER_KEY=2``, ``ENGRAM_MAX_QUEUED_JOBS=3``) and the server's job process
is paused (SIGSTOP), so the jobs it was handed stay queued: past a bound, a request that would
start a job is a 429 with ``Retry-After`` and stores nothing (no job, no concept, no dataset, no
upload spool), while another key is still admitted and a request answered by an existing job is
never refused. Distributed mode counts in Redis: a real ``redis-server`` checks that store.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, running_server, start_redis, stop_redis, wait_for_job
from tests.helpers.api import register_model
from tests.helpers.job_process import job_process, paused

PER_KEY, TOTAL = 2, 3
FACTS = make_facts(12, seed=11)
MODEL = "admitted/tiny"


@dataclass
class World:
    server: LiveServer
    spool: Path
    keys: dict[str, str]  # name -> key

    def client(self, name: str) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.keys[name]}"}
        return httpx.Client(base_url=self.server.base_url, headers=headers, timeout=60.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, model_root: Path) -> Iterator[World]:
    root = tmp_path_factory.mktemp("admission")
    spool = root / "tmp"  # the server's TMPDIR: where an upload is spooled while it is read
    spool.mkdir()
    keys = {name: secrets.token_urlsafe(24) for name in ("a", "b", "admin")}
    api_keys = f"{keys['a']}:write,{keys['b']}:write,{keys['admin']}:admin"
    env = {
        "ENGRAM_API_KEYS": api_keys,
        "ENGRAM_MAX_QUEUED_JOBS_PER_KEY": str(PER_KEY),
        "ENGRAM_MAX_QUEUED_JOBS": str(TOTAL),
        "TMPDIR": str(spool),
    }
    with running_server(root, model_root, **env) as server:
        world = World(server, spool, keys)
        admin = world.client("admin")
        register_model(admin, MODEL, f"file://{tiny_llama_dir}")
        yield world


def _concept(name: str, facts: list[tuple[str, str]] = FACTS[:4]) -> dict[str, Any]:
    records = [{"prompt": p, "completion": c} for p, c in facts]
    return {"name": name, "models": [MODEL], "records": records}


def _stored(server: LiveServer, folder: str) -> set[str]:
    base = server.storage_dir / folder
    return {str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()} if base.exists() else set()


def _assert_too_many(response: httpx.Response, setting: str) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert int(response.headers["retry-after"]) > 0
    problem = response.json()
    assert problem["status"] == 429 and setting in problem["detail"] and "Nothing was submitted" in problem["detail"]


def test_past_the_per_key_bound_a_key_gets_429_and_nothing_is_stored(world: World) -> None:
    a, b, admin = world.client("a"), world.client("b"), world.client("admin")
    with paused(job_process(world.server)):
        assert a.post("/concepts", json=_concept("a-1", FACTS[:4])).status_code == 202
        assert a.post("/concepts", json=_concept("a-2", FACTS[4:8])).status_code == 202
        jobs = {j["job_id"] for j in admin.get("/jobs").json()}
        stored = {f: _stored(world.server, f) for f in ("jobs", "concepts", "datasets")}

        refused = a.post("/concepts", json=_concept("a-3", FACTS[8:12]))
        _assert_too_many(refused, "ENGRAM_MAX_QUEUED_JOBS_PER_KEY")
        upload = a.post(  # the multipart form, spooled to a file while read: the spool goes too
            "/concepts",
            data={"name": "a-4", "models": MODEL},
            files={"dataset": ("d.jsonl", b'{"text": "an uploaded record"}\n', "application/jsonl")},
        )
        _assert_too_many(upload, "ENGRAM_MAX_QUEUED_JOBS_PER_KEY")
        assert a.get("/concepts/a-3").status_code == 404 and a.get("/concepts/a-4").status_code == 404
        assert {j["job_id"] for j in admin.get("/jobs").json()} == jobs
        assert {f: _stored(world.server, f) for f in stored} == stored  # no job, concept or dataset record
        assert not list(world.spool.glob("engram-upload.*"))

        again = a.post("/concepts", json=_concept("a-1", FACTS[:4]))  # the same job: answered, not refused
        assert again.status_code == 202, again.text
        assert {j["job_id"] for j in again.json()["jobs"]} <= jobs

        other = b.post("/concepts", json=_concept("b-1", FACTS[8:12]))  # another key is still admitted
        assert other.status_code == 202, other.text
        # Three jobs queued now: the total bound refuses key b's second, though b has one only.
        _assert_too_many(b.post("/concepts", json=_concept("b-2", FACTS[:2])), "ENGRAM_MAX_QUEUED_JOBS")
    for job_id in {j["job_id"] for j in admin.get("/jobs").json()}:
        assert wait_for_job(admin, job_id)["status"] == "succeeded"
    # Finished jobs free their slots.
    assert a.post("/concepts", json=_concept("a-3", FACTS[8:12])).status_code == 202


@pytest.fixture(scope="module")
def anonymous(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[LiveServer]:
    with running_server(tmp_path_factory.mktemp("anonymous"), model_root, ENGRAM_MAX_QUEUED_JOBS_PER_KEY="1") as server:
        yield server


def test_without_auth_every_caller_is_one_key(anonymous: LiveServer, tiny_llama_dir: Path) -> None:
    """No ENGRAM_API_KEYS: the per-key bound holds for everyone together (a register job is one job)."""
    api = anonymous.client
    with paused(job_process(anonymous)):
        first = api.post("/models", params={"wait": 0}, json={"model_id": "anon/one", "source": f"file://{tiny_llama_dir}"})
        assert first.status_code == 202, first.text
        second = api.post("/models", params={"wait": 0}, json={"model_id": "anon/two", "source": f"file://{tiny_llama_dir}"})
        _assert_too_many(second, "ENGRAM_MAX_QUEUED_JOBS_PER_KEY")
        assert api.get("/models/anon/two").status_code == 404
        followed = api.post(
            "/models", params={"wait": 0}, json={"model_id": "anon/one", "source": f"file://{tiny_llama_dir}"}
        )
        assert followed.status_code == 202 and followed.json()["job_id"] == first.json()["job_id"]
    assert wait_for_job(api, first.json()["job_id"])["status"] == "succeeded"


def test_distributed_api_processes_share_the_bounds(tmp_path: Path, tiny_llama_dir: Path, model_root: Path) -> None:
    """Two API processes on one Redis broker (no worker: their jobs stay queued) count the same jobs:
    the anonymous caller's one queued registration, submitted through either, fills its bound in
    both; cancelling it frees the slot everywhere."""
    from engram_fixtures.live import start_server, stop_server

    redis = start_redis()
    env = {"ENGRAM_BROKER_URL": redis.url, "ENGRAM_MAX_QUEUED_JOBS_PER_KEY": "1"}

    def register(server: LiveServer, model_id: str) -> httpx.Response:
        body = {"model_id": model_id, "source": f"file://{tiny_llama_dir}"}
        return server.client.post("/models", params={"wait": 0}, json=body)

    (tmp_path / "one").mkdir()
    try:
        with running_server(tmp_path / "one", model_root, **env) as one:
            two = start_server(one.storage_dir, model_root, tmp_path / "two.log", **env)
            try:
                first = register(one, "spread/one")
                assert first.status_code == 202, first.text
                _assert_too_many(register(two, "spread/two"), "ENGRAM_MAX_QUEUED_JOBS_PER_KEY")
                assert two.client.get("/models/spread/two").status_code == 404
                cancelled = two.client.delete(f"/jobs/{first.json()['job_id']}")
                assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
                assert register(two, "spread/two").status_code == 202
            finally:
                stop_server(two)
    finally:
        stop_redis(redis)
