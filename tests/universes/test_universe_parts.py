"""Parts of a universe claimed through Redis leases, in this process against a private redis-server:
two builders share a universe's parts and compute each once; a builder waits for a part another
holds, takes it over when that holder's lease expires, and stops waiting when its job is cancelled.
(The lease itself: ``tests/jobs/test_leases.py``.)

(The same against real worker processes, killed and all: ``tests/distributed/test_universe_distributed.py``.)
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from service.jobs.leases import worker_name
from service.jobs.progress import JobCancelled, NoProgress, ProgressReporter
from service.jobs.store import new_job
from service.storage.keys import part_key
from service.universes.parts import UniverseBuild
from service.universes.service import submit_universe
from tests.helpers.jobs import payload_for
from tests.helpers.store_world import StoreWorld, text_records
from tests.helpers.universes import leased_build, run_on_threads, watch_decompositions


@pytest.fixture
def client(redis_client: redis.Redis) -> redis.Redis:
    """The module's private Redis (``tests.helpers.redis``), emptied for each test."""
    return redis_client


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    root = tmp_path_factory.mktemp("universe-parts")
    w = StoreWorld(root)
    w.tiny_llama("p/llama", {"a": text_records(0, 30), "b": text_records(30, 60)}, seed=2)
    return w


def fresh_universe(w: StoreWorld, rcond: float) -> str:
    """A universe recorded (its job created, never run): nothing of it is built yet."""
    view, job = submit_universe(w.ctx, "p/llama", ["a", "b"], rcond)
    assert job is not None and view.status == "building"
    w.pending.clear()
    return str(view.universe_id)


def builder(w: StoreWorld, client: redis.Redis, universe_id: str, ttl_s: float = 2) -> UniverseBuild:
    return leased_build(w.ctx, client, universe_id, ttl_s)


# ---------------------------------------------------------------- builders sharing a universe


def test_two_builders_share_the_parts_and_compute_each_once(
    world: StoreWorld, client: redis.Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    universe_id = fresh_universe(world, rcond=1e-4)
    computed = watch_decompositions(monkeypatch, delay_s=0.05)  # both builders at work at once
    builds = [builder(world, client, universe_id) for _ in range(2)]
    run_on_threads(builds, tmp_path)
    groups = len(builds[0].plan.groups)
    assert len(computed.groups) == groups, "each group decomposed once"
    assert set(computed.threads) == {"b0", "b1"}, "both builders decomposed some"
    assert sum(b.computed["groups"] for b in builds) == groups
    assert sum(b.computed["members"] for b in builds) == len(builds[0].member_of)
    assert builds[0].published() == (set(builds[0].plan.groups), set(builds[0].member_of))


def test_a_part_held_by_a_dead_worker_is_taken_over_when_its_lease_expires(
    world: StoreWorld, client: redis.Redis, tmp_path: Path
) -> None:
    universe_id = fresh_universe(world, rcond=1e-3)
    build = builder(world, client, universe_id)
    held = build.group_order()[0]
    client.set(build.leases.key(f"group:{held}"), "gone:1:dead", px=1500)  # a worker that died holding it
    started = time.monotonic()
    seconds = build.run(tmp_path, NoProgress(), finish=True)
    assert time.monotonic() - started >= 1.2, "the part was not taken before its lease expired"
    assert build.computed["groups"] == len(build.plan.groups)
    record = world.ctx.storage.get_json(part_key(universe_id, "group", held))
    assert record["worker"] == worker_name()
    assert seconds["decomposition"] >= 1.2


def test_a_builder_waiting_on_another_stops_when_its_job_is_cancelled(
    world: StoreWorld, client: redis.Redis, tmp_path: Path
) -> None:
    universe_id = fresh_universe(world, rcond=1e-2)
    build = builder(world, client, universe_id)
    held = build.group_order()[0]
    client.set(build.leases.key(f"group:{held}"), "busy:1:alive", px=60_000)  # held, and kept, elsewhere
    job = world.ctx.jobs.create(new_job("universe", payload_for("universe", universe_id=universe_id), unit="steps"))
    progress = ProgressReporter(world.ctx, job.job_id, build.total_steps)
    cancel = threading.Timer(1.0, lambda: world.ctx.jobs.update(job.job_id, cancel_requested=True))
    cancel.start()
    started = time.monotonic()
    with pytest.raises(JobCancelled):
        build.run(tmp_path, progress, finish=True)
    assert time.monotonic() - started < 5
    assert build.computed["groups"] == len(build.plan.groups) - 1, "everything else was done meanwhile"
    assert progress.done == len(build.plan.groups) - 1, "the job counted the groups done, not the one held"
