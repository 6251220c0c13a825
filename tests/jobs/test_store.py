"""Job records (``service.jobs.store``): what a record holds, where it lives while live and for good,
and what each state change leaves in storage (the record, the open marker, the callback outbox).

Both stores are real: the in-memory one over local storage, and the Redis one against a private
``redis-server`` (live admission control over both: ``tests/api/test_admission.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from api_schemas import Job
from engram_fixtures.live import start_redis, stop_redis
from service.context import Context
from service.errors import JobFailed
from service.jobs.admission import job_owner
from service.jobs.callbacks import event_data
from service.jobs.store import FINISHED, JobStore, RedisJobStore, new_job, public_view, valid_job_id
from service.storage.keys import OPEN_JOBS, PENDING_CALLBACKS, job_key
from tests.helpers.jobs import payload_for


def open_markers(ctx: Context) -> set[str]:
    return {key.removeprefix(OPEN_JOBS) for key in ctx.storage.list(OPEN_JOBS)}


def durable(ctx: Context, job_id: str) -> dict[str, Any]:
    return ctx.storage.get_json(job_key(job_id))


def test_a_new_job_is_queued_with_nothing_done_and_the_requests_owner() -> None:
    token = job_owner.set("key#1")
    try:
        job = new_job("variant", {"model_id": "m", "variant_id": "v"}, unit="layers", callback_urls=["http://a/"])
    finally:
        job_owner.reset(token)
    assert valid_job_id(job.job_id)
    assert job.status == "queued" and job.kind == "variant"
    assert job.progress.model_dump() == {"done": 0, "total": 0, "unit": "layers"}
    assert (job.error, job.result, job.started_at, job.finished_at) == (None, None, None, None)
    assert job.cancel_requested is False
    assert job.callbacks == ("http://a/",) and job.owner == "key#1"
    assert new_job("map", payload_for("map"), unit="layers").owner is None, "a job's own follow-up work has no owner"


def test_the_public_view_shows_the_subject_and_hides_the_payload_and_internals() -> None:
    job = new_job("variant", payload_for("variant", model_id="m", variant_id="v"), unit="layers")
    view = public_view(job).model_dump()
    assert set(view) == set(Job.model_fields)
    assert view["model_id"] == "m" and view["variant_id"] == "v" and view["concept"] is None
    assert "payload" not in view and "owner" not in view and "callbacks" not in view
    # A payload's other fields (here a dataset reference's URI) are not shown either.
    collect = new_job(
        "collect", payload_for("collect", dataset={"uri": "s3://b/hunter2-token.jsonl", "format": "jsonl"}), unit="tokens"
    )
    assert "hunter2-token" not in public_view(collect).model_dump_json()
    assert "hunter2-token" not in json.dumps(event_data(collect)), "nor does a callback carry them"


@pytest.mark.parametrize("job_id", ["", "x" * 31, "x" * 33, "../" + "a" * 29, "a" * 31 + "/"])
def test_an_id_that_is_not_32_alphanumerics_is_no_job(ctx: Context, job_id: str) -> None:
    assert not valid_job_id(job_id)
    assert ctx.jobs.get(job_id) is None and ctx.jobs.get_live(job_id) is None


def test_a_created_job_is_persisted_with_an_open_marker(ctx: Context) -> None:
    job = ctx.jobs.create(new_job("collect", payload_for("collect", concept="c"), unit="tokens"))
    assert durable(ctx, job.job_id) == job.model_dump(mode="json")
    assert open_markers(ctx) == {job.job_id}
    assert ctx.jobs.get(job.job_id) == job


def test_reads_are_frozen_a_caller_cannot_change_the_store_through(ctx: Context) -> None:
    job_id = ctx.jobs.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    seen = ctx.jobs.get(job_id)
    assert seen is not None
    with pytest.raises(ValidationError, match="frozen"):
        seen.status = "failed"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        seen.progress.done = 99  # type: ignore[misc]
    again = ctx.jobs.get(job_id)
    assert again is not None and again.status == "queued" and again.progress.done == 0


def test_an_update_persists_unless_told_not_to(ctx: Context) -> None:
    job_id = ctx.jobs.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    ctx.jobs.update(job_id, status="running")
    assert durable(ctx, job_id)["status"] == "running"
    ctx.jobs.update(job_id, persist=False, error=JobFailed("tick").to_problem())
    assert durable(ctx, job_id)["error"] is None, "a persist=False update stays live"
    assert ctx.jobs.get(job_id).error == JobFailed("tick").to_problem()  # type: ignore[union-attr]


def test_updating_a_job_that_does_not_exist_is_a_key_error(ctx: Context) -> None:
    with pytest.raises(KeyError):
        ctx.jobs.update("a" * 32, status="running")


@pytest.mark.parametrize("final", sorted(FINISHED))
def test_a_final_state_is_persisted_and_drops_the_open_marker(ctx: Context, final: str) -> None:
    job_id = ctx.jobs.create(new_job("map", payload_for("map"), unit="layers")).job_id
    ctx.jobs.update(job_id, status="running")
    assert open_markers(ctx) == {job_id}, "a running job is still open"
    ctx.jobs.update(job_id, status=final)
    assert durable(ctx, job_id)["status"] == final
    assert open_markers(ctx) == set()
    assert ctx.jobs.unfinished() == [] and ctx.jobs.active() == []


def test_progress_ticks_stay_live_and_keep_the_unit(ctx: Context) -> None:
    job_id = ctx.jobs.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    ctx.jobs.set_progress(job_id, 5, 40)
    ctx.jobs.set_progress(job_id, 7)
    assert ctx.jobs.get(job_id).progress.model_dump() == {"done": 7, "total": 40, "unit": "tokens"}  # type: ignore[union-attr]
    assert durable(ctx, job_id)["progress"] == {"done": 0, "total": 0, "unit": "tokens"}
    ctx.jobs.set_progress("b" * 32, 1, 2)  # a job this store does not hold live: nothing to tick, no error


def test_a_job_another_store_holds_is_read_from_storage_but_not_made_live(ctx: Context) -> None:
    """A record missing from the live store is how the reconciler learns Redis lost it: reading it
    from storage must not write it back."""
    job_id = ctx.jobs.create(new_job("variant", payload_for("variant"), unit="layers")).job_id
    restarted = JobStore(ctx.storage)
    assert restarted.get(job_id) == ctx.jobs.get(job_id)
    assert restarted.get_live(job_id) is None
    assert [j.job_id for j in restarted.unfinished()] == [job_id], "found from the open markers"


def test_active_lists_unfinished_jobs_oldest_first(ctx: Context) -> None:
    ids = [ctx.jobs.create(new_job("map", payload_for("map"), unit="layers")).job_id for _ in range(4)]
    ctx.jobs.update(ids[1], status="succeeded")
    ctx.jobs.update(ids[2], status="running")
    assert [j.job_id for j in ctx.jobs.active()] == [ids[0], ids[2], ids[3]]


def test_a_finished_job_whose_last_persist_failed_is_finished_by_the_next_look(ctx: Context) -> None:
    """A crash between the live update and the durable one leaves a finished record with its marker:
    ``unfinished`` persists it again, which writes its callback outbox and drops the marker."""
    job_id = ctx.jobs.create(new_job("map", payload_for("map"), unit="layers", callback_urls=["http://hook/"])).job_id
    ctx.jobs.update(job_id, persist=False, status="succeeded")
    assert open_markers(ctx) == {job_id} and ctx.storage.list(PENDING_CALLBACKS) == []
    assert ctx.jobs.unfinished() == []
    assert open_markers(ctx) == set()
    assert durable(ctx, job_id)["status"] == "succeeded"
    assert len(ctx.storage.list(PENDING_CALLBACKS)) == 1


def test_a_job_with_callbacks_writes_its_outbox_once_when_it_ends(ctx: Context) -> None:
    woken: list[int] = []
    ctx.jobs.on_finished = lambda: woken.append(1)
    urls = ["http://a/hook", "http://b/hook"]
    job_id = ctx.jobs.create(new_job("variant", payload_for("variant"), unit="layers", callback_urls=urls)).job_id
    ctx.jobs.update(job_id, status="running")
    assert ctx.storage.list(PENDING_CALLBACKS) == [] and woken == []
    ctx.jobs.update(job_id, status="failed")
    entries = [ctx.storage.get_json(key) for key in ctx.storage.list(PENDING_CALLBACKS)]
    assert sorted(e["url"] for e in entries) == urls and {e["job_id"] for e in entries} == {job_id}
    assert woken == [1]
    for key in ctx.storage.list(PENDING_CALLBACKS):  # delivered
        ctx.storage.delete(key)
    ctx.jobs.update(job_id, status="failed", error=JobFailed("again").to_problem())
    assert ctx.storage.list(PENDING_CALLBACKS) == [] and woken == [1], "its marker is gone: no second delivery"


def test_a_job_without_callbacks_writes_no_outbox(ctx: Context) -> None:
    woken: list[int] = []
    ctx.jobs.on_finished = lambda: woken.append(1)
    job_id = ctx.jobs.create(new_job("map", payload_for("map"), unit="layers")).job_id
    ctx.jobs.update(job_id, status="succeeded")
    assert ctx.storage.list(PENDING_CALLBACKS) == [] and woken == []


# ---------------------------------------------------------------- the Redis store


def test_the_redis_store_shares_live_records_between_processes(redis_ctx: Context, client: redis.Redis) -> None:
    store = redis_ctx.jobs
    assert isinstance(store, RedisJobStore)
    job_id = store.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    other = RedisJobStore(redis_ctx.storage, client, heartbeat_ttl_s=2)  # another API process or worker
    store.set_progress(job_id, 3, 9)
    assert other.get_live(job_id).progress.model_dump() == {"done": 3, "total": 9, "unit": "tokens"}  # type: ignore[union-attr]
    other.update(job_id, cancel_requested=True)
    assert store.get(job_id).cancel_requested is True  # type: ignore[union-attr]
    assert store.is_live(job_id)
    client.flushdb()  # Redis restarted without persistence
    assert not store.is_live(job_id) and store.get_live(job_id) is None
    assert store.get(job_id).job_id == job_id, "storage still has it"  # type: ignore[index]


def test_a_heartbeat_expires_after_its_ttl(redis_ctx: Context) -> None:
    store = redis_ctx.jobs
    assert isinstance(store, RedisJobStore)
    job_id = store.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    assert not store.alive(job_id)
    store.heartbeat(job_id)
    assert store.alive(job_id)
    ttl = store.redis.ttl(f"engram:job:{job_id}:heartbeat")
    assert 0 < ttl <= store.heartbeat_ttl_s


def test_the_epoch_names_a_redis_incarnation(redis_ctx: Context, client: redis.Redis) -> None:
    store = redis_ctx.jobs
    assert isinstance(store, RedisJobStore)
    first = store.epoch()
    assert store.epoch() == first == RedisJobStore(redis_ctx.storage, client, 2).epoch()
    client.flushdb()
    assert store.epoch() != first


def test_the_redis_store_counts_unfinished_jobs_per_owner(tmp_path: Path) -> None:
    """Distributed mode's counts: sets in Redis that a finished job leaves, and a stale member (its
    process died before it said so) is dropped by the exact count admission asks for before refusing."""
    import redis

    from service.jobs.admission import job_owner
    from service.jobs.store import OPEN_SET, RedisJobStore, new_job
    from service.storage.local import LocalStorage

    server = start_redis()
    try:
        client = redis.Redis.from_url(server.url)
        store = RedisJobStore(LocalStorage(tmp_path), client, heartbeat_ttl_s=30)
        token = job_owner.set("key#1")
        try:
            mine = [store.create(new_job("map", payload_for("map"), unit="layers")) for _ in range(3)]
        finally:
            job_owner.reset(token)
        store.create(new_job("map", payload_for("map"), unit="layers"))  # a job's own follow-up work: no owner
        assert store.open_counts("key#1") == (4, 3)
        assert store.open_counts("key#2") == (4, 0)
        store.update(mine[0].job_id, status="succeeded")
        assert store.open_counts("key#1") == (3, 2)
        client.set(
            f"engram:job:{mine[1].job_id}",
            client.get(f"engram:job:{mine[1].job_id}").replace(b'"queued"', b'"failed"'),
        )
        assert store.open_counts("key#1") == (3, 2)  # the fast count has not seen it finish
        assert store.open_counts("key#1", exact=True) == (2, 1)
        assert client.scard(OPEN_SET + ":key#1") == 1
    finally:
        stop_redis(server)
