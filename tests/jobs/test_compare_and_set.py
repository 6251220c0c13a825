"""Job updates are compare-and-set, and a finished job keeps its outcome (issue 35: a late writer
could move a finished job back).

Every store is real: embedded mode's in-memory store and its SQLite live file (the API process and
the job process each open their own), and distributed mode's Redis store against a private
``redis-server`` (``tests.helpers.redis``), over local storage. Races are run two ways: forced
deterministically (a writer paused between its read and its write while another finishes the job),
and by processes hammering one job's record while it ends.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from engram_fixtures.live import RedisServer
from service.errors import JobFailed
from service.execution.embedded import SqliteJobStore
from service.jobs import store as store_module
from service.jobs.records import JobRecord
from service.jobs.store import FINISHED, JobStore, RedisJobStore, new_job, utc_now
from service.storage.keys import job_key
from service.storage.local import LocalStorage
from tests.helpers.jobs import payload_for

STORES = ("memory", "sqlite", "redis")


def open_store(kind: str, root: Path, redis_url: str) -> JobStore:
    """A job store of ``kind`` over local storage under ``root`` (a new one per process: another
    store over the same live records is another process's view of them)."""
    storage = LocalStorage(root / "store")
    if kind == "sqlite":
        return SqliteJobStore(storage, root / "live.sqlite")
    if kind == "redis":
        return RedisJobStore(storage, redis.Redis.from_url(redis_url), heartbeat_ttl_s=5)
    return JobStore(storage)


@pytest.fixture(params=STORES)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def redis_url(redis_server: RedisServer, redis_client: redis.Redis) -> str:
    """The module's private Redis, emptied for this test."""
    return redis_server.url


@pytest.fixture
def jobs(kind: str, tmp_path: Path, redis_url: str) -> JobStore:
    return open_store(kind, tmp_path, redis_url)


def durable(jobs: JobStore, job_id: str) -> dict[str, Any]:
    stored: dict[str, Any] = jobs.storage.get_json(job_key(job_id))
    return stored


def succeeded_job(jobs: JobStore) -> JobRecord:
    job_id = jobs.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    jobs.update(job_id, status="running", started_at=utc_now())
    jobs.set_progress(job_id, 40, 100)
    return jobs.update(
        job_id,
        status="succeeded",
        result={"tokens": 100},
        progress={"done": 100, "total": 100, "unit": "tokens"},
        finished_at=utc_now(),
    )


LATE_WRITES: dict[str, Callable[[JobStore, str], Any]] = {
    "a progress tick": lambda jobs, job_id: jobs.set_progress(job_id, 7, 100),
    "a progress update": lambda jobs, job_id: jobs.update(job_id, progress={"done": 7, "total": 100, "unit": "tokens"}),
    "a worker that lost its lease starts it": lambda jobs, job_id: jobs.update(
        job_id, status="running", started_at=utc_now(), error=None
    ),
    "a retry puts it back to queued": lambda jobs, job_id: jobs.update(job_id, status="queued", persist=False),
    "a late failure": lambda jobs, job_id: jobs.update(
        job_id, status="failed", error=JobFailed("late").to_problem(), finished_at=utc_now()
    ),
    "a late cancellation": lambda jobs, job_id: jobs.update(job_id, cancel_requested=True, status="cancelled"),
}


@pytest.mark.parametrize("late", sorted(LATE_WRITES))
def test_a_late_write_never_moves_a_finished_job(jobs: JobStore, late: str) -> None:
    done = succeeded_job(jobs)
    LATE_WRITES[late](jobs, done.job_id)
    assert jobs.get(done.job_id) == done, f"{late} changed a succeeded job"
    assert durable(jobs, done.job_id) == done.model_dump(mode="json")
    assert JobStore(jobs.storage).get(done.job_id) == done, "storage keeps the end too"


def test_a_refused_update_answers_the_record_as_it_stands(jobs: JobStore) -> None:
    done = succeeded_job(jobs)
    assert jobs.update(done.job_id, status="running") == done
    queued = jobs.create(new_job("map", payload_for("map"), unit="layers"))
    jobs.update(queued.job_id, status="running")
    kept = jobs.update(queued.job_id, expect=("queued",), status="cancelled", finished_at=utc_now())
    assert kept.status == "running", "compare-and-set: the job is no longer queued"
    assert jobs.update(queued.job_id, expect=("running",), status="succeeded").status == "succeeded"


def test_a_finished_job_still_takes_callback_urls(jobs: JobStore) -> None:
    done = succeeded_job(jobs)
    attached = jobs.update(done.job_id, persist=False, callbacks=("http://hook/",))
    assert attached.callbacks == ("http://hook/",) and attached.status == "succeeded"
    assert attached.model_dump(exclude={"callbacks"}) == done.model_dump(exclude={"callbacks"})


# ---------------------------------------------------------------- a race forced between read and write


class PausedReader:
    """Pauses one thread right after it parsed a live record (inside its read-modify-write) until
    ``release`` is set: the window in which another writer finishes the job."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
        self.paused, self.release = threading.Event(), threading.Event()
        self.thread: int | None = None
        real = module.read_job_record

        def read(stored: Any, job_id: str = "?") -> JobRecord:
            record = real(stored, job_id)
            if threading.get_ident() == self.thread and not self.paused.is_set():
                self.paused.set()
                self.release.wait(10)
            return record

        monkeypatch.setattr(module, "read_job_record", read)

    def run(self, write: Callable[[], Any]) -> threading.Thread:
        def body() -> None:
            self.thread = threading.get_ident()
            write()

        thread = threading.Thread(target=body)
        thread.start()
        assert self.paused.wait(10), "the writer never read the record"
        return thread


@pytest.mark.parametrize("late", ["a progress tick", "a progress update", "a worker that lost its lease starts it"])
def test_redis_a_write_decided_on_a_record_that_finished_meanwhile_is_decided_again(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, late: str
) -> None:
    """Writer A reads the running job and pauses; another process finishes it; A writes. Without a
    compare-and-set A's write (decided on ``running``) replaced the end."""
    writer, finisher = open_store("redis", tmp_path, redis_url), open_store("redis", tmp_path, redis_url)
    job_id = writer.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    writer.update(job_id, status="running")
    pause = PausedReader(monkeypatch, store_module)
    thread = pause.run(lambda: LATE_WRITES[late](writer, job_id))
    done = finisher.update(job_id, status="succeeded", result={"tokens": 3}, finished_at=utc_now())
    pause.release.set()
    thread.join(10)
    assert finisher.get(job_id) == done and writer.get(job_id) == done
    assert durable(finisher, job_id) == done.model_dump(mode="json")


def test_redis_a_cancellation_is_never_lost_to_a_progress_tick(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, api = open_store("redis", tmp_path, redis_url), open_store("redis", tmp_path, redis_url)
    job_id = worker.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id
    worker.update(job_id, status="running")
    pause = PausedReader(monkeypatch, store_module)
    thread = pause.run(lambda: worker.set_progress(job_id, 5, 10))
    api.update(job_id, cancel_requested=True)  # DELETE /jobs/{id} on a running job
    pause.release.set()
    thread.join(10)
    seen = api.get(job_id)
    assert seen is not None and seen.cancel_requested is True, "the tick overwrote the cancellation"
    assert seen.progress.done == 5, "and the tick, decided again on the newer record, still counts"


# ---------------------------------------------------------------- processes racing one job's end


def hammer(kind: str, root: str, redis_url: str, job_ids: list[str], ready: Any, stop: Any) -> None:
    """A late writer in a process of its own: progress ticks and updates, and a worker starting the
    job again, on every job, from before they end until ``stop`` (long after); ``ready`` once it writes."""
    jobs = open_store(kind, Path(root), redis_url)
    tick = 0
    while not stop.is_set():
        for job_id in job_ids:
            tick += 1
            jobs.set_progress(job_id, tick % 90, 100)
            jobs.update(job_id, persist=tick % 3 == 0, progress={"done": tick % 90, "total": 100, "unit": "tokens"})
            if tick % 5 == 0:
                jobs.update(job_id, status="running", error=None)
        ready.set()


def watch(jobs: JobStore, job_ids: list[str], stop: threading.Event) -> dict[str, list[str]]:
    """Every status each job showed, polled as a client polls, until ``stop``."""
    seen: dict[str, list[str]] = {job_id: [] for job_id in job_ids}
    while not stop.is_set():
        for job_id in job_ids:
            job = jobs.get(job_id)
            if job is not None and (not seen[job_id] or seen[job_id][-1] != job.status):
                seen[job_id].append(job.status)
    return seen


@pytest.fixture
def spawn() -> Iterator[Callable[..., Any]]:
    """``spawn(*args)``: a :func:`hammer` process (spawned: it imports the code afresh), and its ready
    event; the processes are told to stop (the returned stop event) and joined after the test."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    started: list[Any] = []

    def start(*args: Any) -> tuple[Any, Any, Any]:
        ready = context.Event()
        process = context.Process(target=hammer, args=(*args, ready, stop), daemon=True)
        process.start()
        started.append(process)
        return process, ready, stop

    yield start
    stop.set()
    for process in started:
        process.join(30)
        if process.is_alive():
            process.kill()


@pytest.mark.parametrize("store_kind", ["sqlite", "redis"])
def test_late_writers_in_other_processes_never_move_a_finished_job_back(
    tmp_path: Path, redis_url: str, spawn: Callable[..., Any], store_kind: str
) -> None:
    jobs = open_store(store_kind, tmp_path, redis_url)
    job_ids = [jobs.create(new_job("collect", payload_for("collect"), unit="tokens")).job_id for _ in range(6)]
    for job_id in job_ids:
        jobs.update(job_id, status="running")
    writers = [spawn(store_kind, str(tmp_path), redis_url, job_ids) for _ in range(2)]
    for _, ready, _ in writers:
        assert ready.wait(120), "a writer never started writing"
    stop_watching = threading.Event()
    seen: dict[str, list[str]] = {}
    watcher = threading.Thread(
        target=lambda: seen.update(watch(open_store(store_kind, tmp_path, redis_url), job_ids, stop_watching))
    )
    watcher.start()
    final = {"done": 100, "total": 100, "unit": "tokens"}
    ends = {}
    for i, job_id in enumerate(job_ids):
        status = ("succeeded", "failed", "cancelled")[i % 3]
        ends[job_id] = jobs.update(job_id, status=status, progress=final, finished_at=utc_now())
        assert ends[job_id].status == status
        time.sleep(0.2)
    time.sleep(1.0)  # the writers go on writing after every job ended
    writers[0][2].set()
    for process, _, _ in writers:
        process.join(30)
        assert process.exitcode == 0, "a writer crashed"
    stop_watching.set()
    watcher.join(10)
    for job_id, end in ends.items():
        assert jobs.get(job_id) == end, f"job {job_id} left {end.status}"
        assert durable(jobs, job_id) == end.model_dump(mode="json"), "storage says it is not finished"
        after = seen[job_id][seen[job_id].index(end.status) :] if end.status in seen[job_id] else []
        assert after == [end.status], f"job {job_id} was seen {seen[job_id]}"
    assert all(end.status in FINISHED for end in ends.values())
