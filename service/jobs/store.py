"""Job records and where they live: in memory or Redis while live, in object storage for good.

A job is a small frozen record (:class:`service.jobs.records.JobRecord`: kind, status, progress,
error, result, timestamps) plus the IDs its task needs (its kind's payload model). Every store
writes ``model_dump(mode="json")`` and reads through :func:`service.jobs.records.read_job_record`
(the one migration of older records). Tasks take a job ID, re-read everything from storage and write
content-addressed outputs, so running one twice is harmless.

Object storage is the durable truth: every state change is persisted to ``jobs/<id>.json``, and an
unfinished job also has a marker ``jobs/open/<id>`` so a restarted process (or a reconciler after a
Redis restart) finds what was in flight without listing every job ever run. Live records (and the
frequent progress ticks) live in memory (embedded mode) or in Redis (distributed mode).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable, Collection
from datetime import datetime, timezone
from typing import Any

from redis.exceptions import WatchError

from api_schemas import Job
from service.jobs import callbacks
from service.jobs.admission import job_owner
from service.jobs.records import AnyPayload, JobKind, JobRecord, ProgressCounts, UnreadableJobRecord, read_job_record
from service.jobs.transitions import FINISHED, next_record
from service.observability import record_job_state
from service.storage.base import Storage, StorageUnavailable
from service.storage.keys import JOBS, OPEN_JOBS, job_key
from service.storage.stored_json import UnreadableRecord, find_record

__all__ = [
    "FINISHED",
    "JobKind",
    "JobRecord",
    "JobStore",
    "RedisJobStore",
    "job_answer",
    "new_job",
    "public_view",
    "utc_now",
]
OPEN_SET = "engram:open-jobs"  # Redis: the unfinished jobs' IDs (``:<owner>`` for one owner's)
log = logging.getLogger("engram.jobs")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat()


def new_job(kind: JobKind, payload: AnyPayload, unit: str, callback_urls: list[str] | None = None) -> JobRecord:
    """A fresh queued job record; ``callback_urls`` are POSTed the job when it ends. ``owner``: the
    API key whose request submits it (admission control counts it against that key), None for the
    follow-up work a job submits itself."""
    return JobRecord(
        job_id=uuid.uuid4().hex,
        kind=kind,
        progress=ProgressCounts(unit=unit),
        created_at=utc_now(),
        payload=payload,
        callbacks=tuple(callback_urls or ()),
        owner=job_owner.get(),
    )


def public_view(job: JobRecord) -> Job:
    """The job as the API shows it: the contract's :class:`~api_schemas.Job` (no payload, no
    internals). A callback carries the same fields as stored (:func:`service.jobs.callbacks.event_data`)."""
    return Job.model_validate(callbacks.event_data(job))


job_answer = public_view  # the name the routes answer it by


def valid_job_id(job_id: str) -> bool:
    return len(job_id) == 32 and job_id.isalnum()


class JobStore:
    """Live job records in memory, persisted to storage on every state change.

    Records are frozen: a change is a new record (:meth:`JobRecord.updated`) written in place of
    the old one, under this store's lock, so every change is a compare-and-set: it is decided on the
    record it replaces. A finished job keeps its outcome (:func:`service.jobs.transitions.next_record`):
    a late writer (a progress tick, a worker that lost its lease) changes nothing."""

    # Whether a live read is a memory or local-file read, cheap enough for the event loop (see
    # service.api.fast_status); False for Redis, a network round trip.
    reads_are_local = True

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._live: dict[str, JobRecord] = {}
        self._lock = threading.RLock()
        self.on_finished: Callable[[], None] | None = None  # wakes this process's callback dispatcher

    # -- live records: overridden by the Redis store
    def _read_live(self, job_id: str) -> JobRecord | None:
        return self._live.get(job_id)

    def _write_live(self, job: JobRecord) -> None:
        self._live[job.job_id] = job

    # -- the public surface
    def create(self, job: JobRecord) -> JobRecord:
        with self._lock:
            self._write_live(job)
            self.storage.put_bytes(OPEN_JOBS + job.job_id, b"")
            self._persist(job)
            record_job_state(job.kind, job.status)
            return job

    def get(self, job_id: str) -> JobRecord | None:
        if not valid_job_id(job_id):
            return None
        with self._lock:
            job = self._read_live(job_id)
            return self._load_durable(job_id) if job is None else job

    def get_live(self, job_id: str) -> JobRecord | None:
        """The live record only (no storage read): None when this store does not hold it."""
        return self._read_live(job_id) if valid_job_id(job_id) else None

    def update(
        self, job_id: str, *, persist: bool = True, expect: Collection[str] | None = None, **fields: Any
    ) -> JobRecord:
        """Set fields of a job, as one compare-and-set on its current record; ``persist=False`` for
        frequent progress ticks.

        Args:
            expect: the statuses the job may be in for the change to apply (None: any unfinished
                one; a finished job only takes new callback URLs, whatever ``expect`` says).

        Returns:
            The record as it stands now: the changed one, or the current one unchanged when the
            change was refused (a caller that must know compares its ``status``).

        Raises:
            KeyError: no such job.
        """
        with self._lock:
            current = self._read_live(job_id) or self._load_durable(job_id)
            if current is None:
                raise KeyError(job_id)
            job = next_record(current, fields, expect)
            if job is None:
                return current
            self._write_live(job)
            _count_state(current, job)
            if persist:
                self._persist(job)
            return job

    def set_progress(self, job_id: str, done: int, total: int | None = None) -> None:
        """A progress tick, kept live only (never on a finished job: its count is final)."""
        with self._lock:
            job = self._read_live(job_id)
            changed = None if job is None else next_record(job, progress_fields(job, done, total), None)
            if changed is not None:
                self._write_live(changed)

    def open_counts(self, owner: str, *, exact: bool = False) -> tuple[int, int]:
        """(jobs not finished in total, those of ``owner``): what admission control bounds.
        ``exact``: recount from the records where a store keeps a faster, drifting count."""
        jobs = [j for j in self._live.values() if j.status not in FINISHED]
        return len(jobs), sum(1 for j in jobs if j.owner == owner)

    def unfinished(self) -> list[JobRecord]:
        """Jobs not known to be finished, from the durable markers (survives any restart)."""
        found = []
        for job in self.marked_open():
            if job.status not in FINISHED:
                found.append(job)
            else:
                self._persist(job)  # finished, but its last persist failed: finish it now
        return found

    def active(self) -> list[JobRecord]:
        """Jobs not finished yet, oldest first (from the durable markers: every mode, any restart)."""
        return sorted((j for j in self.marked_open() if j.status not in FINISHED), key=lambda j: j.created_at)

    def recorded(self) -> list[JobRecord]:
        """Every job ever run, finished ones too, from their durable records (``jobs/<id>.json``: storage
        keeps them for good; a live store prunes finished ones, this reads past that). One read per job:
        what browsing the history costs, so routes use :meth:`active` when only unfinished jobs are asked."""
        ids = (key.removeprefix(JOBS).removesuffix(".json") for key in self.storage.list(JOBS))
        found = (self.readable(job_id) for job_id in ids if valid_job_id(job_id))
        return [job for job in found if job is not None]

    def marked_open(self) -> list[JobRecord]:
        """The records of the open markers (finished ones too: their last persist may have failed)."""
        found = (self.readable(key.removeprefix(OPEN_JOBS)) for key in self.storage.list(OPEN_JOBS))
        return [job for job in found if job is not None]

    def readable(self, job_id: str) -> JobRecord | None:
        """:meth:`get` for a pass over many jobs: a record that cannot be read is None here, with an
        error naming it in the log (one damaged record must not stop every other job's recovery or
        admission); reading it by ID (``GET /jobs/{id}``) still raises :class:`UnreadableJobRecord`."""
        try:
            return self.get(job_id)
        except UnreadableJobRecord as exc:
            log.error("%s", exc.detail, extra={"record_key": job_key(job_id), "reason": exc.detail})
            return None

    def _load_durable(self, job_id: str) -> JobRecord | None:
        """The persisted record. Not written back to the live store: a record missing there is how
        the reconciler learns that Redis lost it (and its queued message with it)."""
        try:
            stored = find_record(self.storage, job_key(job_id))
        except UnreadableRecord as exc:
            raise UnreadableJobRecord(job_id, exc.why) from None
        return None if stored is None else read_job_record(stored, job_id)

    def _persist(self, job: JobRecord) -> None:
        self.storage.put_json(job_key(job.job_id), job.model_dump(mode="json"))
        if job.status not in FINISHED:
            return
        # The outbox is written while the open marker still exists: a crash in between leaves the
        # marker, and the next persist of this finished job (restart, reconciler) writes it again.
        marker = OPEN_JOBS + job.job_id
        if job.callbacks and self.storage.exists(marker):
            callbacks.enqueue(self.storage, job)
            if self.on_finished is not None:
                self.on_finished()
        self.storage.delete(marker)


def progress_fields(job: JobRecord, done: int, total: int | None) -> dict[str, Any]:
    counts = {"done": done} if total is None else {"done": done, "total": total}
    return {"progress": {**job.progress.model_dump(), **counts}}


def _count_state(before: JobRecord, after: JobRecord) -> None:
    if after.status != before.status:
        record_job_state(after.kind, after.status)


_CAS_TRIES = 1000  # a WATCH retried this often has met a writer per try: something is wrong, say so


class RedisJobStore(JobStore):
    """Live records in Redis, shared by every API process and worker.

    A state change that cannot reach storage (S3 down) is still recorded in Redis, and the job's
    open marker stays, so the reconciler persists it once storage is back.
    """

    reads_are_local = False

    def __init__(self, storage: Storage, redis: Any, heartbeat_ttl_s: int) -> None:
        super().__init__(storage)
        self.redis = redis
        self.heartbeat_ttl_s = heartbeat_ttl_s

    def _read_live(self, job_id: str) -> JobRecord | None:
        raw = self.redis.get(_live_key(job_id))
        return None if raw is None else read_job_record(json.loads(raw), job_id)

    # -- admission counts: a set of unfinished job IDs in total and one per owner. A job leaves them
    # when a store records it finished; a process that dies in between leaves a stale member, which
    # open_counts(exact=True) drops (admission asks for it before it refuses anyone).
    def create(self, job: JobRecord) -> JobRecord:
        with self.redis.pipeline() as pipe:
            pipe.sadd(OPEN_SET, job.job_id)
            if job.owner:
                pipe.sadd(OPEN_SET + ":" + job.owner, job.job_id)
            pipe.execute()
        try:
            return super().create(job)
        except BaseException:
            self._forget_open(job)
            raise

    def update(
        self, job_id: str, *, persist: bool = True, expect: Collection[str] | None = None, **fields: Any
    ) -> JobRecord:
        """:meth:`JobStore.update` over Redis: the live record is WATCHed, the change decided on it
        and written in a MULTI that fails when another process wrote it meanwhile (then decided
        again on the newer record), so no writer overwrites a change it did not see."""
        current, job = self._compare_and_set(job_id, lambda found: next_record(found, fields, expect), durable=True)
        if job is None:
            return current
        _count_state(current, job)
        if persist:
            self._persist(job)
            self._persist_if_finished_since(job)
        if job.status in FINISHED:
            self._forget_open(job)
        return job

    def set_progress(self, job_id: str, done: int, total: int | None = None) -> None:
        try:
            self._compare_and_set(job_id, lambda found: next_record(found, progress_fields(found, done, total), None))
        except KeyError:
            return  # not live here: nothing to tick

    def _compare_and_set(
        self, job_id: str, change: Callable[[JobRecord], JobRecord | None], *, durable: bool = False
    ) -> tuple[JobRecord, JobRecord | None]:
        """(the record the change was decided on, the record written: None when ``change`` refused).

        ``durable``: a job Redis does not hold (it restarted) is read from storage and made live.

        Raises:
            KeyError: no such job (live, or durable with ``durable``).
        """
        key = _live_key(job_id)
        with self.redis.pipeline() as pipe:
            for _ in range(_CAS_TRIES):
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    current = read_job_record(json.loads(raw), job_id) if raw is not None else None
                    if current is None and durable:
                        current = self._load_durable(job_id)
                    if current is None:
                        raise KeyError(job_id)
                    job = change(current)
                    if job is None:
                        return current, None
                    pipe.multi()
                    pipe.set(key, job.model_dump_json())
                    pipe.execute()
                    return current, job
                except WatchError:
                    continue  # another writer changed it since the read: decide again on its record
        raise RuntimeError(f"job {job_id}: its record changed under each of {_CAS_TRIES} tries to update it")

    def _persist_if_finished_since(self, job: JobRecord) -> None:
        """Storage takes writes in the order they arrive, not the order Redis took them: a writer
        whose persist of an unfinished record lands after another's persist of the job's end would
        leave storage saying it runs. Each persist of an unfinished record reads the live one after
        it, and persists an end found there again (its outbox is written once: the marker is gone)."""
        if job.status in FINISHED:
            return
        latest = self._read_live(job.job_id)
        if latest is not None and latest.status in FINISHED:
            self._persist(latest)

    def open_counts(self, owner: str, *, exact: bool = False) -> tuple[int, int]:
        mine = OPEN_SET + ":" + owner
        if exact:
            for key in (OPEN_SET, mine):
                members = [m.decode() for m in self.redis.smembers(key)]
                # An unreadable record counts as stale: nothing can run it.
                stale = [m for m in members if (j := self.readable(m)) is None or j.status in FINISHED]
                if stale:
                    self.redis.srem(key, *stale)
        return int(self.redis.scard(OPEN_SET)), int(self.redis.scard(mine))

    def _forget_open(self, job: JobRecord) -> None:
        with self.redis.pipeline() as pipe:
            pipe.srem(OPEN_SET, job.job_id)
            if job.owner:
                pipe.srem(OPEN_SET + ":" + job.owner, job.job_id)
            pipe.execute()

    def _write_live(self, job: JobRecord) -> None:
        self.redis.set(_live_key(job.job_id), job.model_dump_json())

    def _persist(self, job: JobRecord) -> None:
        try:
            super()._persist(job)
        except StorageUnavailable as exc:
            log.warning("job %s: state kept in Redis only until storage is back (%s)", job.job_id, exc)

    def heartbeat(self, job_id: str) -> None:
        """A worker says it is alive and working on this job."""
        self.redis.set(f"engram:job:{job_id}:heartbeat", "1", ex=self.heartbeat_ttl_s)

    def alive(self, job_id: str) -> bool:
        return bool(self.redis.exists(f"engram:job:{job_id}:heartbeat"))

    def is_live(self, job_id: str) -> bool:
        """Whether Redis still holds this job's record (False after a Redis restart)."""
        return bool(self.redis.exists(_live_key(job_id)))

    def epoch(self) -> str:
        """A token naming this Redis incarnation: a restart without persistence changes it, and
        with it every queued message is gone."""
        self.redis.set("engram:epoch", uuid.uuid4().hex, nx=True)
        return self.redis.get("engram:epoch").decode()


def _live_key(job_id: str) -> str:
    return f"engram:job:{job_id}"
