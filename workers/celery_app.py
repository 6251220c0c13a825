"""The Celery app of distributed mode: Redis broker and backend, queues ``gpu`` and ``cpu``.

The tasks are thin: each runs :func:`service.execution.runner.run_job`, as embedded mode's job process
does, and takes its name and queue from the job table (:data:`service.execution.kinds.KINDS`).
Every task sets ``acks_late`` and ``reject_on_worker_lost``, so a worker that dies mid-task leaves
its message to be redelivered, and the broker's visibility timeout is above the hard time limit,
so a live task is never handed to a second worker.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from celery import Task
from celery.signals import worker_init, worker_process_init, worker_ready, worker_shutdown

from service.config import get_settings
from service.context import Context
from service.execution.kinds import import_bodies
from service.execution.queues import make_celery
from service.execution.runner import KINDS, TRANSIENT_ERRORS, UNIVERSE_HELPER, retry_after, run_job, run_universe_helper
from service.execution.runtime import build_runtime
from service.jobs.presence import worker_presence
from service.jobs.store import JobKind
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


worker_process_init.connect(_warm_pool_process, weak=False)


def job_task(kind: JobKind) -> Any:
    """The Celery task of a job kind, named and queued as :data:`KINDS` says."""
    return app.task(name=KINDS[kind].task, bind=True, queue=KINDS[kind].queue, acks_late=True, reject_on_worker_lost=True)


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


@app.task(name=UNIVERSE_HELPER[0], bind=True, queue=UNIVERSE_HELPER[1], acks_late=True, reject_on_worker_lost=True)
def help_universe(self: Task, *, universe_id: str, job_id: str) -> None:
    """Decompose input groups (then write members' engrams) of a universe that job ``job_id`` builds."""
    run_universe_helper(worker_context(), universe_id, job_id)


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
