"""Embedded mode's job process: jobs run in a child process, never in the API's interpreter.

Why a process and not threads of the API: a job thread and the request handlers share one GIL.
Under heavy polling (hundreds of status requests a second) the event loop holds the GIL most of the
time, and a collection, which needs the GIL between every torch call, was measured 23-65× slower.
In a process of its own the job competes for CPU cores only, which the OS shares fairly.

The two processes share the live job records through a SQLite file (WAL mode: readers never wait
for the writer): the API reads status and writes cancellation, the job process writes progress and
outcomes. Object storage stays the durable truth, as in distributed mode (``jobs/<id>.json``).

The job process dies with its parent (``PR_SET_PDEATHSIG`` on Linux, plus a watchdog), so a
``kill -9`` of the API never leaves an orphan working. If the job process itself dies (out of
memory, a crash in native code), the API fails the jobs it was running with a problem that says
so, starts a new one, and hands it the jobs still queued. The job process limits its own memory
(``ENGRAM_JOB_MEMORY_BYTES``, :mod:`service.execution.memory_budget`), so a job that needs more
fails by name and the process lives on; the death of the process names that budget.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from service.config import Settings
from service.context import Context
from service.errors import JobFailed, ProblemDetails
from service.execution.kinds import KINDS, import_bodies
from service.execution.memory_budget import apply_job_memory_limit, died_problem
from service.jobs.records import JobRecord, UnreadableJobRecord, read_job_record
from service.jobs.store import JobStore, utc_now, valid_job_id
from service.observability import configure_logging
from service.storage.base import Storage
from service.storage.factory import open_storage

log = logging.getLogger("engram.embedded")

_WARM = "warm"  # the job process's event once it has imported every job body
# The job process imports the job bodies once its inbox has been quiet this long with no job running
# (a job that arrives at start-up, a registration, runs first, importing only its own body).
_WARM_UP_AFTER_IDLE_S = 0.2
_KEEP_FINISHED = timedelta(hours=1)  # finished records stay in the live file this long (storage keeps them forever)
_MONITOR_S = 0.5


def live_store_path(settings: Settings) -> Path:
    """The live-record file of this storage URL on this machine (two services never share one)."""
    tag = hashlib.sha256(settings.storage_url.encode()).hexdigest()[:16]
    return settings.cache_dir / "jobs" / f"live-{tag}.sqlite"


class SqliteJobStore(JobStore):
    """Live job records in a SQLite file shared by the API process and its job process.

    Every read-modify-write (``update``, ``set_progress``) runs in one ``BEGIN IMMEDIATE``
    transaction, so a cancellation written by the API and a progress tick written by the job
    process can never overwrite each other. Reads take no lock (WAL snapshots).
    """

    def __init__(self, storage: Storage, path: Path) -> None:
        super().__init__(storage)
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._lock = _Transaction(self._connection)  # type: ignore[assignment]
        with self._lock:
            self._connection().execute(
                "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, kind TEXT, status TEXT, "
                "finished_at TEXT, body TEXT NOT NULL)"
            )

    def _connection(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            # Autocommit mode: transactions are opened explicitly by _Transaction.
            connection = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=True)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")  # storage is the durable record, not this file
            self._local.connection = connection
        return connection

    def _read_live(self, job_id: str) -> JobRecord | None:
        row = self._connection().execute("SELECT body FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return None if row is None else read_job_record(json.loads(row[0]), job_id)

    def _write_live(self, job: JobRecord) -> None:
        # An upsert, not INSERT OR REPLACE: a replaced row gets a new rowid, and the rowid is the
        # creation order that with_status lists (and a replaced job process is handed) jobs in.
        self._connection().execute(
            "INSERT INTO jobs (job_id, kind, status, finished_at, body) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (job_id) DO UPDATE SET kind = excluded.kind, status = excluded.status, "
            "finished_at = excluded.finished_at, body = excluded.body",
            (job.job_id, job.kind, job.status, job.finished_at, job.model_dump_json()),
        )

    def get(self, job_id: str) -> JobRecord | None:
        # A status poll: one indexed read of the live file, no lock, no storage round trip.
        job = self.get_live(job_id)
        if job is None and valid_job_id(job_id):
            job = self._load_durable(job_id)  # pruned from the live file, or from another machine
        return job

    def with_status(self, statuses: tuple[str, ...]) -> list[JobRecord]:
        """Live records in any of ``statuses``, oldest first."""
        marks = ",".join("?" * len(statuses))
        rows = self._connection().execute(
            f"SELECT job_id, body FROM jobs WHERE status IN ({marks}) ORDER BY rowid", statuses
        )
        return [job for (job_id, body) in rows if (job := _readable_row(job_id, body)) is not None]

    def active(self) -> list[JobRecord]:
        return self.with_status(("queued", "running"))

    def open_counts(self, owner: str, *, exact: bool = False) -> tuple[int, int]:
        # Unfinished rows only (admission keeps them to a few hundred): exact, as the file is the truth.
        jobs = self.active()
        return len(jobs), sum(1 for j in jobs if j.owner == owner)

    def queued_by_queue(self) -> dict[str, int]:
        """Jobs waiting to run, named like the distributed queues (gpu: the model runs; cpu: builds)."""
        depths = {"gpu": 0, "cpu": 0}
        rows = self._connection().execute("SELECT kind, COUNT(*) FROM jobs WHERE status = 'queued' GROUP BY kind")
        for kind, count in rows:
            # A kind this version does not know counts as cpu (so does a variant building its universe).
            depths[KINDS[kind].queue if kind in KINDS else "cpu"] += int(count)
        return depths

    def prune(self, keep: timedelta = _KEEP_FINISHED) -> None:
        """Drop live records of jobs finished long ago (their durable records stay in storage)."""
        cutoff = (datetime.now(timezone.utc) - keep).isoformat()
        with self._lock:
            self._connection().execute("DELETE FROM jobs WHERE finished_at IS NOT NULL AND finished_at < ?", (cutoff,))


def _readable_row(job_id: str, body: str) -> JobRecord | None:
    """A live row's record; one that cannot be read (written by a newer version sharing the file)
    is None, with an error naming it, so that no listing and no monitor pass stops at it."""
    try:
        return read_job_record(json.loads(body), job_id)
    except (UnreadableJobRecord, ValueError) as exc:
        log.error("job %s: %s", job_id, exc)
        return None


class _Transaction:
    """A re-entrant lock of this process's threads that is also a SQLite write transaction."""

    def __init__(self, connection: Callable[[], sqlite3.Connection]) -> None:
        self._connection = connection
        self._thread_lock = threading.RLock()
        self._depth = threading.local()

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        depth = getattr(self._depth, "value", 0)
        if depth == 0:
            try:
                self._connection().execute("BEGIN IMMEDIATE")
            except BaseException:
                self._thread_lock.release()
                raise
        self._depth.value = depth + 1

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._depth.value -= 1
        try:
            if self._depth.value == 0:
                self._connection().execute("ROLLBACK" if exc_type is not None else "COMMIT")
        finally:
            self._thread_lock.release()


# ---------------------------------------------------------------- the API side


class ProcessExecutor:
    """Hands jobs to the job process, watches it, and replaces it when it dies."""

    def __init__(self, settings: Settings, jobs: SqliteJobStore, on_finished: Callable[[], None] | None = None) -> None:
        self.settings, self.jobs = settings, jobs
        self.on_finished = on_finished
        self._mp = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        self._process: Any = None
        self._inbox: Any = None
        self._events: Any = None
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._cancel_seen: dict[str, float] = {}  # job -> when the monitor first saw its cancellation
        self._warm = threading.Event()  # the current job process has imported every job body

    def start(self) -> None:
        self._spawn()
        self._monitor = threading.Thread(target=self._watch, name="engram-job-process-monitor", daemon=True)
        self._monitor.start()

    def submit(self, job: JobRecord) -> None:
        with self._start_lock:
            if self._stopping.is_set():  # stored as queued: the next start re-queues it (requeue_interrupted)
                return
            if self._inbox is None:
                self._spawn_locked()
            self._inbox.put(_message(job))

    def depths(self) -> dict[str, int]:
        return self.jobs.queued_by_queue()

    def warm(self) -> bool:
        """The job process has imported every job body: a job submitted now starts at once."""
        return self._warm.is_set()

    def shutdown(self) -> None:
        self._stopping.set()
        process, inbox = self._process, self._inbox
        if process is None:
            return
        with contextlib.suppress(Exception):
            inbox.put(None)
        process.join(timeout=5)
        if process.is_alive():  # a job is mid-way: it is re-queued at the next start (tasks are idempotent)
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
        self._close_queues()

    def _close_queues(self) -> None:
        """Release the queues' semaphores now (issue 40: every SIGTERM ended with "resource_tracker: There
        appear to be 6 leaked semaphore objects"): the monitor is stopped first, as it reads the events."""
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=2 * _MONITOR_S + 1)
        for channel in (self._inbox, self._events):
            if channel is not None:
                channel.close()
                channel.join_thread()
        self._inbox = self._events = None

    def _spawn(self) -> None:
        with self._start_lock:
            self._spawn_locked()

    def _spawn_locked(self) -> None:
        self._warm.clear()
        self._inbox, self._events = self._mp.Queue(), self._mp.Queue()
        self._process = self._mp.Process(
            target=job_process_main,
            args=(self.settings, self._inbox, self._events, os.getpid()),
            name="engram-jobs",
            daemon=True,
        )
        self._process.start()
        log.info("job process %s started", self._process.pid)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            try:
                event = self._events.get(timeout=_MONITOR_S)
                if event == _WARM:
                    self._warm.set()
                elif self.on_finished is not None:
                    self.on_finished()
            except queue.Empty:
                pass
            except (EOFError, OSError, ValueError):  # the queue went with a dead process
                time.sleep(_MONITOR_S)
            if not self._stopping.is_set() and not self._process.is_alive():
                self._replace_dead_process()
            elif not self._stopping.is_set():
                self._enforce_bounds()

    def _enforce_bounds(self) -> None:
        """Kill the job process when a running job ignores its cancellation for ENGRAM_CANCEL_GRACE_S,
        or has run past ENGRAM_TASK_HARD_LIMIT_S: stuck where no check runs (native code, a blocking
        read), it would hold its lane, and every job queued behind it, until a restart."""
        running = self.jobs.with_status(("running",))
        now = time.monotonic()
        asked = {job.job_id for job in running if job.cancel_requested}
        self._cancel_seen = {job_id: self._cancel_seen.get(job_id, now) for job_id in asked}
        ignored = {j for j, since in self._cancel_seen.items() if now - since >= self.settings.cancel_grace_s}
        overdue = {job.job_id for job in running if _seconds_since(job.started_at) > self.settings.task_hard_limit_s}
        if ignored or overdue:
            self._kill_and_replace(ignored, overdue - ignored)

    def _kill_and_replace(self, ignored: set[str], overdue: set[str]) -> None:
        """Kill the job process: the jobs that had to stop are cancelled or failed, the others it was
        running (other lanes) go back to the queue, and a new process takes the queue."""
        log.warning(
            "killing the job process %s: job(s) %s did not stop within %gs of cancellation, %s ran past %ss",
            self._process.pid,
            sorted(ignored),
            self.settings.cancel_grace_s,
            sorted(overdue),
            self.settings.task_hard_limit_s,
        )
        with self._start_lock:
            self._process.kill()
            self._process.join(timeout=10)
            for job in self.jobs.with_status(("running",)):  # read again: a job may have ended meanwhile
                job_id = job.job_id
                if job_id in ignored:
                    self.jobs.update(job_id, status="cancelled", finished_at=utc_now())
                elif job_id in overdue:
                    self.jobs.update(job_id, status="failed", error=_overdue_problem(self.settings), finished_at=utc_now())
                else:
                    self.jobs.update(job_id, status="queued", started_at=None)
            self._cancel_seen.clear()
            self._spawn_locked()
            for job in self.jobs.with_status(("queued",)):
                self._inbox.put(_message(job))
        if self.on_finished is not None:
            self.on_finished()  # the cancelled and failed jobs' callbacks

    def _replace_dead_process(self) -> None:
        code = self._process.exitcode
        reason = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        log.error("the job process died (%s); starting a new one", reason)
        for job in self.jobs.with_status(("running",)):
            self.jobs.update(job.job_id, status="failed", error=died_problem(self.settings, reason), finished_at=utc_now())
        self._spawn()
        for job in self.jobs.with_status(("queued",)):
            self.submit(job)


def _message(job: JobRecord) -> dict[str, str]:
    """What the job process is handed of a job: its ID and the kind whose lane runs it."""
    return {"job_id": job.job_id, "kind": job.kind}


def _seconds_since(timestamp: str | None) -> float:
    """Seconds since an ISO timestamp of a job record (0 when there is none)."""
    if not timestamp:
        return 0.0
    try:
        started = datetime.fromisoformat(timestamp)
    except ValueError:
        return 0.0
    if started.tzinfo is None:
        started = started.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - started).total_seconds()


def _overdue_problem(settings: Settings) -> ProblemDetails:
    # A JobFailed (422): the user can act (less work, or a higher limit).
    return JobFailed(
        f"the job ran past {settings.task_hard_limit_s} s (ENGRAM_TASK_HARD_LIMIT_S) and was stopped; "
        "raise the limit, or submit less work (fewer or shorter records, a smaller model)"
    ).to_problem()


# ---------------------------------------------------------------- the job process


def job_process_main(settings: Settings, inbox: Any, events: Any, parent_pid: int) -> None:
    """The job process: run every job the API hands over, in its kind's lane, until told to stop."""
    _die_with_parent(parent_pid)
    configure_logging()
    apply_job_memory_limit(settings)  # before any job: past it a job fails by name, this process lives
    storage = open_storage(settings.storage_url, settings.s3_endpoint_url)
    jobs = SqliteJobStore(storage, live_store_path(settings))
    jobs.on_finished = lambda: events.put("finished")  # the API's callback dispatcher delivers
    ctx = Context(settings=settings, storage=storage, jobs=jobs, dispatch=_no_dispatch, lock=threading.RLock())
    from service.execution.runner import run_job  # the job process imports the bodies, the API never does

    executor = EmbeddedExecutor(lambda job_id: run_job(ctx, job_id))
    warm = False
    while True:
        try:
            message = inbox.get(timeout=_WARM_UP_AFTER_IDLE_S)
        except queue.Empty:
            # The bodies are imported now, not in the first job after a restart: by this thread,
            # while no job runs (messages wait in the inbox meanwhile). Never beside a running job:
            # two threads importing transformers at once can see it half-initialised (ImportError).
            if not warm and executor.idle():
                _warm_up(events)
                warm = True
            continue
        if message is None:
            break
        executor.submit(message)
    executor.shutdown()


def _warm_up(events: Any) -> None:
    """Import every job body, then tell the API (``/readyz``: ``job_process`` ``ready``)."""
    try:
        import_bodies()
    except Exception:  # a body that cannot be imported fails its own jobs, by name, when they run
        log.exception("importing the job bodies failed; each job imports its own when it runs")
    events.put(_WARM)


class EmbeddedExecutor:
    """Runs the job process's jobs in threads: one single-thread lane per :attr:`Kind.lane`
    (:data:`service.execution.kinds.KINDS`), so a compose does not wait behind a long collection, a
    quick evaluation neither, and two collections never fight over the same cores."""

    def __init__(self, run: Callable[[str], None]) -> None:
        self._run = run
        lanes = sorted({kind.lane for kind in KINDS.values()})
        self._lanes = {lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engram-{lane}") for lane in lanes}
        self._in_flight = 0  # jobs submitted and not finished
        self._count_lock = threading.Lock()

    def submit(self, message: dict[str, str]) -> None:
        """Run a job the API handed over (:func:`_message`) in its kind's lane."""
        with self._count_lock:
            self._in_flight += 1
        self._lanes[KINDS[message["kind"]].lane].submit(self._counted, message["job_id"])  # type: ignore[index]

    def idle(self) -> bool:
        """No job is queued in a lane or running."""
        with self._count_lock:
            return self._in_flight == 0

    def _counted(self, job_id: str) -> None:
        try:
            self._run(job_id)
        finally:
            with self._count_lock:
                self._in_flight -= 1

    def shutdown(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)


def _no_dispatch(job: JobRecord) -> None:
    raise RuntimeError(f"job {job.job_id}: a job body may not start other jobs")


def _die_with_parent(parent_pid: int) -> None:
    """Make sure this process never outlives the API that started it."""
    with contextlib.suppress(Exception):  # Linux only; the watchdog below covers the rest
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watchdog() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watchdog, name="engram-parent-watchdog", daemon=True).start()
