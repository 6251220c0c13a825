"""The Celery app of distributed mode: Redis broker and backend, queues ``gpu`` and ``cpu``.

The tasks are thin: they run the same :func:`service.tasks.run_job` that embedded mode runs in the
API process. Both named decorators set ``acks_late`` and ``reject_on_worker_lost``, so a worker that
dies mid-task leaves its message to be redelivered, and the broker's visibility timeout is above
the hard time limit, so a live task is never handed to a second worker.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from celery import Task
from celery.signals import worker_init, worker_ready, worker_shutdown

from service.config import get_settings
from service.jobs import utc_now
from service.queues import UNIVERSE_HELPER, make_celery
from service.storage.janitor import worker_janitor
from service.worker_presence import worker_presence

log = logging.getLogger("engram.worker")
settings = get_settings()
app = make_celery(settings)
worker_init.connect(worker_janitor(settings), weak=False)  # a crashed worker's leftovers, before the pool starts
_announce, _withdraw = worker_presence(settings)  # the API's /readyz: which queues have a live consumer
worker_ready.connect(_announce, weak=False)
worker_shutdown.connect(_withdraw, weak=False)


@cache
def worker_context() -> Any:
    """This worker process's storage, job store and settings (built once, on first use)."""
    from service.runtime import build_runtime

    return build_runtime(settings, background=False).ctx


def _run(task: Task, job_id: str) -> None:
    from service.tasks import TRANSIENT_ERRORS, run_job

    ctx = worker_context()
    try:
        run_job(ctx, job_id, raise_transient=True)
    except TRANSIENT_ERRORS as exc:
        retries = task.request.retries
        if retries >= settings.task_max_retries:
            problem = {
                "type": "https://engram.dev/problems/service-unavailable",
                "title": "Service unavailable",
                "status": 503,
                "detail": f"gave up after {retries} retries: {exc}",
            }
            ctx.jobs.update(job_id, status="failed", error=problem, finished_at=utc_now())
            return
        # Exponential backoff, capped: 2, 4, 8, ... 60 seconds.
        raise task.retry(exc=exc, countdown=min(60, 2 ** (retries + 1)), max_retries=settings.task_max_retries) from exc


def gpu_task(name: str) -> Any:
    return app.task(name=name, bind=True, queue="gpu", acks_late=True, reject_on_worker_lost=True)


def cpu_task(name: str) -> Any:
    return app.task(name=name, bind=True, queue="cpu", acks_late=True, reject_on_worker_lost=True)


@gpu_task("engram.collect")
def collect(self: Task, *, job_id: str) -> None:
    """Collect one concept's statistics on one model."""
    _run(self, job_id)


@cpu_task("engram.build_variant")
def build_variant(self: Task, *, job_id: str) -> None:
    """Build one variant from cached statistics."""
    _run(self, job_id)


@gpu_task("engram.build_universe")
def build_universe(self: Task, *, job_id: str) -> None:
    """Decompose a universe's input groups once and store every member's engrams."""
    _run(self, job_id)


@gpu_task(UNIVERSE_HELPER[0])
def help_universe(self: Task, *, universe_id: str, job_id: str) -> None:
    """Decompose input groups (then write members' engrams) of a universe that job ``job_id`` builds."""
    from service.tasks import run_universe_helper

    run_universe_helper(worker_context(), universe_id, job_id)


@gpu_task("engram.evaluate")
def evaluate(self: Task, *, job_id: str) -> None:
    """Score probes on a variant and its base model."""
    _run(self, job_id)


@gpu_task("engram.generate")
def generate(self: Task, *, job_id: str) -> None:
    """Greedy generation from a prompt on a variant and/or its base model."""
    _run(self, job_id)


@gpu_task("engram.calibrate")
def calibrate(self: Task, *, job_id: str) -> None:
    """Search edit strengths and module sets on probes; build the recommended variant."""
    _run(self, job_id)
