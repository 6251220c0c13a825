"""Distributed mode's safety net (``service.jobs.reconcile``): one pass over the open jobs against a
private ``redis-server`` and local storage, in each situation where nobody would run a job unless it
is dispatched again, and in those where it must be left alone.

(The same end to end, with real workers killed and Redis restarted: ``tests/distributed/``.)
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from service.context import Context
from service.jobs.reconcile import reconcile_once, reconciler
from service.jobs.store import RedisJobStore, new_job
from service.storage.keys import OPEN_JOBS
from tests.helpers.jobs import payload_for


@pytest.fixture
def store(redis_ctx: Context) -> RedisJobStore:
    assert isinstance(redis_ctx.jobs, RedisJobStore)
    return redis_ctx.jobs


class Queue:
    """What a dispatch sends, as ``CelerySender.dispatch`` stamps it: the epoch it was queued in."""

    def __init__(self, store: RedisJobStore) -> None:
        self.store, self.sent = store, []  # type: list[str]

    def __call__(self, job: dict[str, Any]) -> None:
        self.store.update(job.job_id, persist=False, dispatch_epoch=self.store.epoch())
        self.sent.append(job.job_id)


def queued(store: RedisJobStore, queue: Queue, **fields: Any) -> str:
    job_id = str(store.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id)
    queue(store.get(job_id))  # type: ignore[arg-type]
    if fields:
        store.update(job_id, **fields)
    queue.sent.clear()
    return job_id


def status(store: RedisJobStore, job_id: str) -> str:
    job = store.get(job_id)
    assert job is not None
    return str(job.status)


def test_jobs_that_someone_will_run_are_left_alone(store: RedisJobStore) -> None:
    queue = Queue(store)
    waiting = queued(store, queue)
    running = queued(store, queue, status="running")
    store.heartbeat(running)
    assert reconcile_once(store, queue) == [] and queue.sent == []
    assert (status(store, waiting), status(store, running)) == ("queued", "running")


def test_a_job_whose_worker_stopped_its_heartbeats_is_dispatched_again(store: RedisJobStore) -> None:
    queue = Queue(store)
    job_id = queued(store, queue, status="running")  # its worker died before a first beat, or its beats expired
    assert reconcile_once(store, queue) == [job_id] and queue.sent == [job_id]
    assert status(store, job_id) == "queued"
    assert reconcile_once(store, queue) == [], "dispatched in this epoch: not again"


def test_a_job_redis_lost_is_restored_from_storage_and_dispatched_again(store: RedisJobStore, client: redis.Redis) -> None:
    queue = Queue(store)
    waiting, running = queued(store, queue), queued(store, queue, status="running")
    client.flushdb()  # Redis restarted without persistence: records, messages and heartbeats gone
    assert sorted(reconcile_once(store, queue)) == sorted([waiting, running])
    for job_id in (waiting, running):
        assert store.is_live(job_id) and status(store, job_id) == "queued"


def test_a_message_queued_in_an_earlier_redis_is_dispatched_again(store: RedisJobStore, client: redis.Redis) -> None:
    """Redis restarted (a new epoch) and someone restored the record, not the message."""
    queue = Queue(store)
    job_id = queued(store, queue)
    record = client.get(f"engram:job:{job_id}")
    client.flushdb()
    client.set(f"engram:job:{job_id}", record)  # type: ignore[arg-type]
    assert reconcile_once(store, queue) == [job_id]


def test_a_queued_job_cancelled_and_lost_is_cancelled_not_dispatched(store: RedisJobStore, client: redis.Redis) -> None:
    queue = Queue(store)
    job_id = queued(store, queue, cancel_requested=True)
    client.flushdb()
    assert reconcile_once(store, queue) == [] and queue.sent == []
    assert status(store, job_id) == "cancelled"
    assert not store.storage.exists(OPEN_JOBS + job_id)


def test_a_finished_job_whose_final_state_missed_storage_is_persisted(store: RedisJobStore) -> None:
    """S3 was down when it ended: Redis has the outcome, storage the open marker."""
    queue = Queue(store)
    job_id = queued(store, queue)
    store.update(job_id, persist=False, status="succeeded", result={"ok": True})
    assert store.storage.exists(OPEN_JOBS + job_id)
    assert reconcile_once(store, queue) == [] and queue.sent == []
    assert store.storage.get_json(f"jobs/{job_id}.json")["status"] == "succeeded"
    assert not store.storage.exists(OPEN_JOBS + job_id)


def test_the_reconciler_runs_in_one_process_at_a_time(store: RedisJobStore, client: redis.Redis) -> None:
    """Another API process holds the reconcile lock: this one's passes do nothing until it is freed."""
    queue = Queue(store)
    job_id = queued(store, queue, status="running")
    held = client.lock("engram:lock:reconcile", timeout=30)
    assert held.acquire(blocking=False)
    duty = reconciler(store, queue, interval_s=0.05)
    duty.start()
    try:
        time.sleep(0.5)
        assert queue.sent == [], "the lock's holder reconciles, not this process"
        held.release()
        deadline = time.monotonic() + 5
        while not queue.sent and time.monotonic() < deadline:
            time.sleep(0.02)
        assert queue.sent[:1] == [job_id]
    finally:
        duty.stop()
    assert not any(t.name == "engram-reconciler" and t.is_alive() for t in threading.enumerate())
