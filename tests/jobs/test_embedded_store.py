"""Embedded mode's live records (``service.execution.embedded.SqliteJobStore``): a SQLite file the API
process and its job process share. Two store objects on one file stand for the two processes (each
has its own connections, as each process would); storage is LocalStorage in a temporary folder."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest

from service.execution.embedded import SqliteJobStore
from service.jobs.admission import job_owner
from service.jobs.store import new_job
from service.storage.local import LocalStorage
from tests.helpers.jobs import payload_for


@pytest.fixture
def stores(tmp_path: Path) -> tuple[SqliteJobStore, SqliteJobStore]:
    storage = LocalStorage(tmp_path / "store")
    path = tmp_path / "cache" / "jobs" / "live.sqlite"
    return SqliteJobStore(storage, path), SqliteJobStore(storage, path)


def test_the_api_and_the_job_process_see_each_others_writes(stores: tuple[SqliteJobStore, SqliteJobStore]) -> None:
    api, worker = stores
    job_id = api.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    worker.update(job_id, status="running")
    worker.set_progress(job_id, 3, 10)
    seen = api.get(job_id)
    assert seen is not None and seen.status == "running" and seen.progress.done == 3
    api.update(job_id, cancel_requested=True)
    assert worker.get(job_id).cancel_requested is True  # type: ignore[union-attr]


def test_a_cancellation_and_progress_ticks_never_overwrite_each_other(
    stores: tuple[SqliteJobStore, SqliteJobStore],
) -> None:
    """Each read-modify-write is one transaction: a tick written by the job process right after the
    API's cancellation keeps the cancellation, and the cancellation keeps the ticks."""
    api, worker = stores
    job_id = api.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    halfway = threading.Event()

    def tick() -> None:
        for done in range(1, 301):
            worker.set_progress(job_id, done, 300)
            if done == 150:
                halfway.set()

    ticking = threading.Thread(target=tick)
    ticking.start()
    assert halfway.wait(30)
    api.update(job_id, cancel_requested=True)
    ticking.join(30)
    job = api.get(job_id)
    assert job is not None and job.cancel_requested is True and job.progress.done == 300


def test_a_failed_write_rolls_back_and_frees_the_file(stores: tuple[SqliteJobStore, SqliteJobStore]) -> None:
    api, worker = stores
    with pytest.raises(KeyError):
        api.update("d" * 32, status="running")  # no such job, inside the write transaction
    job_id = worker.create(new_job("map", payload_for("map"), unit="layers")).job_id  # the other process can write at once
    assert api.get(job_id) is not None


def test_status_lists_and_counts_read_the_live_file(stores: tuple[SqliteJobStore, SqliteJobStore]) -> None:
    api, worker = stores
    token = job_owner.set("key#1")
    try:
        mine = [api.create(new_job(kind, payload_for(kind), unit="u")).job_id for kind in ("collect", "variant", "universe")]
    finally:
        job_owner.reset(token)
    other = api.create(new_job("register", payload_for("register"), unit="u")).job_id
    worker.update(mine[1], status="running")
    worker.update(mine[2], status="succeeded")
    assert [j.job_id for j in api.active()] == [mine[0], mine[1], other], "oldest first"
    assert [j.job_id for j in api.with_status(("running",))] == [mine[1]]
    assert api.open_counts("key#1") == (3, 2)
    assert api.queued_by_queue() == {"gpu": 1, "cpu": 1}  # collect: gpu, register: cpu


def test_queued_jobs_stay_in_creation_order_whatever_was_written_last(
    stores: tuple[SqliteJobStore, SqliteJobStore],
) -> None:
    """A replaced job process is handed the queued jobs in this order: a job that was running when its
    process was replaced, or that got a callback URL while it waited, keeps its place."""
    api, worker = stores
    first, second, third = (api.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id for _ in range(3))
    worker.update(first, status="running")
    worker.update(first, status="queued", started_at=None)  # its process was replaced
    api.update(second, persist=False, callbacks=["http://hook/"])
    assert [j.job_id for j in api.with_status(("queued",))] == [first, second, third]


def test_pruned_records_are_still_read_from_storage(stores: tuple[SqliteJobStore, SqliteJobStore]) -> None:
    api, _ = stores
    done = api.create(new_job("map", payload_for("map"), unit="layers")).job_id
    waiting = api.create(new_job("map", payload_for("map"), unit="layers")).job_id
    api.update(done, status="succeeded", finished_at="2000-01-01T00:00:00+00:00")
    api.prune(keep=timedelta(hours=1))
    assert api.get_live(done) is None, "finished long ago: gone from the live file"
    assert api.get(done).status == "succeeded", "storage keeps it"  # type: ignore[union-attr]
    assert api.get_live(waiting) is not None, "unfinished records are never pruned"
