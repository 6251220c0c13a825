"""Issue 35, finding 9: identical evaluate and generate requests made a new job each (unlearn follows
the job that exists), so 139 of 140 concurrent identical evaluates were refused 429.

Now an identical request (the same variant and probes and options, or the same generation payload),
from any key that may submit one, follows the job queued or running for it, and an evaluation whose
result is stored is answered by the job that stored it; admission control counts none of these as
new work. A request that differs starts its own job.

The concurrent requests go through a real server (uvicorn, a process of its own) in distributed
mode over a private Redis with no worker listening, so every job stays queued while the 40 requests
arrive: the test cannot race a job that finishes first. The variant they ask about is built
beforehand in the same store by the real job bodies (tests.helpers.store_world). The stored-result
and admission cases run the service functions over real file storage in this process.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, RedisServer, running_server
from service.api.routes.jobs import cancel_job
from service.evaluation.service import submit_evaluation, submit_generation
from service.jobs.admission import TooManyJobs, job_owner
from service.variants.service import submit_variant
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "follow/llama"
FACTS = make_facts(12, seed=5)
PROBES = {"forget": [{"prompt": p, "completion": c} for p, c in FACTS[:3]]}
OTHER_PROBES = {"forget": [{"prompt": p, "completion": c} for p, c in FACTS[3:6]]}
CONCURRENT = 40
# Per key: the two evaluations and the two generations this module's server starts, and no more;
# on the previous code the 40 identical requests hit it at their fifth.
PER_KEY = 4


def make_world(root: Path) -> tuple[StoreWorld, str]:
    """A tiny Llama with two concepts and a ready delta variant unlearning one; its ID."""
    world = StoreWorld(root)
    world.tiny_llama(MODEL, {"a": text_records(0, 20, 11), "b": text_records(20, 40, 11)})
    view, _ = submit_variant(world.ctx, MODEL, {"a": -1.0}, 1.0, {"scaling": "uniform", "format": "delta"})
    for job in world.run_pending():
        assert job.status == "succeeded", job
    return world, str(view.variant_id)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[tuple[LiveServer, str, list[str]]]:
    """A server with two write keys over a store holding a ready variant, its jobs queued for good."""
    root = tmp_path_factory.mktemp("follow")
    _, variant_id = make_world(root)
    keys = [secrets.token_urlsafe(24) for _ in range(2)]
    env = {
        "ENGRAM_BROKER_URL": redis_server.url,  # and no worker: what is queued stays queued
        "ENGRAM_API_KEYS": ",".join(f"{key}:write" for key in keys),
        "ENGRAM_MAX_QUEUED_JOBS_PER_KEY": str(PER_KEY),
    }
    with running_server(root, root / "models", **env) as server:
        yield server, variant_id, keys


def post_at_once(server: LiveServer, keys: list[str], path: str, body: dict[str, Any]) -> list[httpx.Response]:
    """``CONCURRENT`` identical POSTs released together from as many threads, the keys taking turns."""
    clients = [httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {k}"}, timeout=120) for k in keys]
    start = threading.Barrier(CONCURRENT)

    def post(i: int) -> httpx.Response:
        start.wait()
        return clients[i % len(clients)].post(path, json=body)

    try:
        with ThreadPoolExecutor(CONCURRENT) as pool:
            return list(pool.map(post, range(CONCURRENT)))
    finally:
        for client in clients:
            client.close()


def one_job(answers: list[httpx.Response]) -> str:
    """The one job every answer names (every one a 200 or 202, none a 429)."""
    statuses = sorted({a.status_code for a in answers})
    assert set(statuses) <= {200, 202}, (statuses, [a.text for a in answers if a.status_code not in (200, 202)][:2])
    jobs = {a.json()["job_id"] for a in answers}
    assert len(jobs) == 1, f"{len(jobs)} jobs for {len(answers)} identical requests"
    return jobs.pop()


def test_identical_concurrent_evaluations_follow_one_job(live: tuple[LiveServer, str, list[str]]) -> None:
    server, variant_id, keys = live
    path = f"/variants/{variant_id}/evaluate"
    job_id = one_job(post_at_once(server, keys, path, PROBES))
    again = server.client.post(path, json=PROBES, headers={"Authorization": f"Bearer {keys[0]}"})
    assert again.status_code == 202 and again.json()["job_id"] == job_id
    other = server.client.post(path, json=OTHER_PROBES, headers={"Authorization": f"Bearer {keys[1]}"})
    assert other.status_code == 202 and other.json()["job_id"] != job_id, "other probes: a job of their own"


def test_identical_concurrent_generations_follow_one_job(live: tuple[LiveServer, str, list[str]]) -> None:
    server, variant_id, keys = live
    path = f"/variants/{variant_id}/generate"
    body = {"prompt": FACTS[0][0], "max_new_tokens": 4}
    job_id = one_job(post_at_once(server, keys, path, body))
    auth = {"Authorization": f"Bearer {keys[1]}"}
    longer = server.client.post(path, json={**body, "max_new_tokens": 5}, headers=auth)
    assert longer.status_code == 202 and longer.json()["job_id"] != job_id, "another length: a job of its own"


# ---------------------------------------------------------------- in process: results and admission


@pytest.fixture
def world(tmp_path: Path) -> tuple[StoreWorld, str]:
    return make_world(tmp_path)


def test_a_stored_evaluation_is_answered_by_the_job_that_stored_it(world: tuple[StoreWorld, str]) -> None:
    store, variant_id = world
    first = submit_evaluation(store.ctx, variant_id, PROBES, None)
    [done] = store.run_pending()
    assert done.status == "succeeded"
    again = submit_evaluation(store.ctx, variant_id, PROBES, None)
    assert again.job_id == first.job_id and again.status == "succeeded" and again.result == done.result
    assert store.pending == [], "nothing queued"
    other = submit_evaluation(store.ctx, variant_id, OTHER_PROBES, None)
    assert cancel_job(other.job_id, store.ctx).status == "cancelled"
    store.pending.clear()
    retried = submit_evaluation(store.ctx, variant_id, OTHER_PROBES, None)
    assert retried.job_id != other.job_id, "a cancelled job answers nothing: the request starts anew"


def test_following_a_job_is_never_refused_by_admission(world: tuple[StoreWorld, str]) -> None:
    store, variant_id = world
    store.ctx.settings = store.ctx.settings.model_copy(update={"max_queued_jobs_per_key": 1})
    token = job_owner.set("key-one")
    try:
        queued = submit_generation(store.ctx, variant_id, "Hello", 3, ["variant"], None)
        followed = submit_generation(store.ctx, variant_id, "Hello", 3, ["variant"], None)
        assert followed.job_id == queued.job_id and len(store.pending) == 1
        with pytest.raises(TooManyJobs):  # a different request is new work: past the bound
            submit_generation(store.ctx, variant_id, "Hello", 4, ["variant"], None)
        store.run_pending()
        assert store.ctx.jobs.get(queued.job_id).status == "succeeded"  # type: ignore[union-attr]
        after = submit_generation(store.ctx, variant_id, "Hello", 3, ["variant"], None)
        assert after.job_id != queued.job_id, "a finished generation is run again: its text is stored by no content key"
    finally:
        job_owner.reset(token)
