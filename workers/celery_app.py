"""The Celery app of distributed mode: Redis broker and backend, queues ``gpu`` and ``cpu``.

The tasks are thin: each runs :func:`service.execution.runner.run_job`, as embedded mode's job process
does, and takes its name and queue from the job table (:data:`service.execution.kinds.KINDS`).
Every task sets ``acks_late`` and ``reject_on_worker_lost``, so a worker that dies mid-task leaves
its message to be redelivered, and the broker's visibility timeout is above the hard time limit,
so a live task is never handed to a second worker. A pool process that dies under a job while its
worker lives on (out of memory, most likely) fails that job instead (:class:`JobRequest`), and each
pool process limits its own memory (``ENGRAM_JOB_MEMORY_BYTES``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import Task
from celery.signals import worker_init, worker_process_init, worker_ready, worker_shutdown
from celery.worker import state as worker_state
from celery.worker.request import Request

from service.config import get_settings
from service.context import Context
from service.execution.kinds import import_bodies
from service.execution.memory_budget import apply_job_memory_limit, died_problem
from service.execution.queues import make_celery
from service.execution.runner import HELPERS, KINDS, TRANSIENT_ERRORS, retry_after, run_helper, run_job
from service.execution.runtime import build_runtime
from service.jobs.presence import worker_presence
from service.jobs.store import FINISHED, JobKind, RedisJobStore, utc_now
from service.storage.factory import open_storage
from service.storage.janitor import worker_janitor

log = logging.getLogger("engram.worker")
settings = get_settings()
app = make_celery(settings)
worker_init.connect(worker_janitor(settings), weak=False)  # a crashed worker's leftovers, before the pool starts
# The job bodies (torch, transformers) imported before the pool forks: no task waits for them.
worker_init.connect(lambda **_: import_bodies(), weak=False)
_announce, _withdraw = worker_presence(settings)  # the API's /readyz: which queues have a live consumer
worker_ready.connect(_announce, weak=False)
worker_shutdown.connect(_withdraw, weak=False)


_context: Context | None = None
_context_lock = threading.Lock()  # the warm-up thread and a first task may both ask


def worker_context() -> Context:
    """This worker process's storage, job store and settings (built once, on first use)."""
    global _context
    with _context_lock:
        if _context is None:
            _context = build_runtime(settings, background=False).ctx
        return _context


def _warm_pool_process(**_: Any) -> None:
    """Build a pool process's context as the process starts, not in its first task: the storage
    client, the Redis connection and a first request to the store (its connection opened) cost the
    first job after a restart 0.3-0.5 s of "queued" time. On a thread: Celery gives a new pool
    process a few seconds to report that it is up, and a store that is slow to answer must not
    cost the process. A failure is only logged: the first task tries again and reports it."""

    def warm() -> None:
        try:
            worker_context().storage.ping()
        except Exception:
            log.warning("could not prepare this pool process; its first task will try again", exc_info=True)

    threading.Thread(target=warm, name="engram-warm-up", daemon=True).start()


# Before the pool process runs any task: a job past ENGRAM_JOB_MEMORY_BYTES fails by name, the
# pool process and the worker live on (set here, not in the main process, which runs no job).
worker_process_init.connect(lambda **_: apply_job_memory_limit(settings), weak=False)
worker_process_init.connect(_warm_pool_process, weak=False)


class JobRequest(Request):
    """A job task's request, in the worker's main process: when the pool process running it dies
    (the kernel's OOM killer, a native library aborting on a failed allocation, a stuck job ended
    after its cancellation), the job is ended here, before Celery requeues the message: failed,
    naming the memory budget, or cancelled when that was asked. Without this the redelivered message
    would run the job again, and an input that kills its process would kill one after another."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback wraps it
        stopping = worker_state.should_stop is not None or worker_state.should_terminate is not None
        if isinstance(exc, WorkerLostError) and not stopping:  # a worker shutting down redelivers
            _end_lost_job(self.kwargs.get("job_id"), str(exc))
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def _end_lost_job(job_id: str | None, reason: str) -> None:
    """Fail (or, when asked, cancel) a job whose pool process died under it. A store of its own,
    dropped after: this main process forks the next pool process, which must not share its sockets."""
    if job_id is None or settings.broker_url is None:
        return
    client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        jobs = RedisJobStore(open_storage(settings.storage_url, settings.s3_endpoint_url), client, settings.heartbeat_ttl_s)
        job = jobs.get(job_id)
        if job is None or job.status in FINISHED:
            return
        if job.cancel_requested:
            jobs.update(job_id, status="cancelled", finished_at=utc_now())
        else:
            log.error("job %s: its pool process died (%s)", job_id, reason)
            jobs.update(job_id, status="failed", error=died_problem(settings, reason), finished_at=utc_now())
    except Exception:  # Redis or storage away: the redelivered message runs the job again
        log.warning("could not end job %s after its pool process died", job_id, exc_info=True)
    finally:
        client.close()


def job_task(kind: JobKind) -> Any:
    """The Celery task of a job kind, named and queued as :data:`KINDS` says."""
    return app.task(
        name=KINDS[kind].task,
        bind=True,
        queue=KINDS[kind].queue,
        acks_late=True,
        reject_on_worker_lost=True,
        Request=JobRequest,
    )


def helper_task(kind: JobKind) -> Any:
    """The Celery task of a kind's helper (:data:`HELPERS`), named by the table, on its kind's queue
    (not a job: whatever a helper leaves undone, its job does itself)."""
    return app.task(name=HELPERS[kind].task, bind=True, queue=KINDS[kind].queue, acks_late=True, reject_on_worker_lost=True)


def _run(task: Task, job_id: str) -> None:
    """Run the job; after a transient error, retry the task with backoff until the runner gives up."""
    ctx = worker_context()
    try:
        run_job(ctx, job_id, raise_transient=True, stuck_cancel=_end_pool_process)
    except TRANSIENT_ERRORS as exc:
        delay = retry_after(ctx, job_id, exc, task.request.retries, settings.task_max_retries)
        if delay is not None:
            raise task.retry(exc=exc, countdown=delay, max_retries=settings.task_max_retries) from exc


def _end_pool_process() -> None:
    """A job stuck past its cancellation (native code, a blocking read): end this pool process. The
    task is ``reject_on_worker_lost``, so its message comes back, and the runner, finding the job's
    cancellation, marks it cancelled; the worker starts a fresh pool process for the next task."""
    os.kill(os.getpid(), signal.SIGKILL)


@job_task("collect")
def collect(self: Task, *, job_id: str) -> None:
    """Collect one concept's statistics on one model."""
    _run(self, job_id)


@job_task("variant")
def build_variant(self: Task, *, job_id: str) -> None:
    """Build one variant from cached statistics."""
    _run(self, job_id)


@job_task("universe")
def build_universe(self: Task, *, job_id: str) -> None:
    """Decompose a universe's input groups once and store every member's engrams."""
    _run(self, job_id)


@job_task("map")
def build_map(self: Task, *, job_id: str) -> None:
    """Compute one memory-trace map from cached statistics and the model's weights."""
    _run(self, job_id)


@job_task("register")
def register_model(self: Task, *, job_id: str) -> None:
    """Download and inspect a remote checkpoint, then write its registration."""
    _run(self, job_id)


@helper_task("universe")
def help_universe(self: Task, *, universe_id: str, job_id: str) -> None:
    """Decompose input groups (then write members' engrams) of a universe that job ``job_id`` builds."""
    run_helper(worker_context(), "universe", universe_id, job_id)


@job_task("evaluate")
def evaluate(self: Task, *, job_id: str) -> None:
    """Score probes on a variant and its base model."""
    _run(self, job_id)


@job_task("generate")
def generate(self: Task, *, job_id: str) -> None:
    """Greedy generation from a prompt on a variant and/or its base model."""
    _run(self, job_id)


@job_task("calibrate")
def calibrate(self: Task, *, job_id: str) -> None:
    """Search edit strengths and module sets on probes; build the recommended variant."""
    _run(self, job_id)
