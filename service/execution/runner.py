"""The job runner: the state machine every job goes through, running the body :mod:`service.execution.kinds` names.

A body is a function ``(ctx, job) -> result`` in its domain, named by the table as a string: the
runner imports no domain. It is the same in both modes: embedded mode's job process (:mod:`service.execution.embedded`) and
distributed mode's Celery tasks (:mod:`workers.celery_app`) call :func:`run_job`. A body re-reads
its inputs from storage, checks whether its output already exists (a redelivered job then finishes
at once), works in a private scratch directory, and publishes content-addressed outputs with the
manifest last. Nothing half-written is visible.

The state machine: ``queued`` → ``running`` → ``succeeded`` | ``failed`` | ``cancelled``; a
transient error (storage or Redis briefly away) puts the job back to ``queued`` for a retry, until
:func:`retry_after` says it had its tries. While a body runs, a heartbeat tells the reconciler
(:mod:`service.jobs.reconcile`) its worker is alive. A body may run a job it created inline
(``ctx.run_inline``, this runner); a kind's helpers (:class:`~service.execution.kinds.Helper`) run
through :func:`run_helper`.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis.exceptions
from pydantic import BaseModel

from service.context import Context
from service.engine.errors import CollectionCancelled
from service.errors import JobFailed, ProblemDetails, ProblemError, ServiceUnavailable
from service.execution.kinds import HELPERS, KINDS, Kind, Queue
from service.execution.memory_budget import exhausted_memory, out_of_memory_problem, release_freed_memory
from service.jobs.leases import worker_name
from service.jobs.progress import JobCancelled
from service.jobs.records import JobKind
from service.jobs.store import FINISHED, RedisJobStore, utc_now
from service.observability import job_context
from service.storage.base import StorageUnavailable

log = logging.getLogger("engram.runner")

__all__ = ["HELPERS", "KINDS", "Kind", "Queue", "retry_after", "run_helper", "run_job", "stored_result"]


# Errors worth a retry: the job's inputs are fine, a service it needs is briefly away.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    StorageUnavailable,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


def run_job(
    ctx: Context, job_id: str, *, raise_transient: bool = False, stuck_cancel: Callable[[], None] | None = None
) -> None:
    """Run one job to a final state; the outcome is in the job record.

    Args:
        ctx: storage, jobs and settings of this process.
        job_id: the job to run (a finished one is left alone: redelivery is harmless).
        raise_transient: re-raise a transient error (storage or Redis unreachable) after putting
            the job back to ``queued``, so the caller (Celery) can retry it with backoff.
        stuck_cancel: called when the job is still running ENGRAM_CANCEL_GRACE_S after its
            cancellation was asked (stuck where no check runs: native code, a blocking read); a
            Celery worker ends its pool process, and the redelivered message finds the job cancelled.
    """
    if ctx.run_inline is None:  # what a body runs a job it created with (a calibration's variant)
        ctx.run_inline = run_job
    job = ctx.jobs.get(job_id)
    if job is None or job.status in FINISHED:
        return
    if job.cancel_requested:
        ctx.jobs.update(job_id, status="cancelled", finished_at=utc_now())
        return
    if ctx.jobs.update(job_id, status="running", started_at=utc_now(), error=None).cancel_requested:
        # A DELETE landed between the read above and this write: the job was answered cancelled.
        ctx.jobs.update(job_id, status="cancelled", finished_at=utc_now())
        return
    ran_out = False
    try:
        with job_context(job_id), _heartbeat(ctx, job_id), _cancel_watchdog(ctx, job_id, stuck_cancel):
            log.info("%s job started", job.kind)
            kind = KINDS[job.kind]
            result = {**stored_result(kind, job.kind, kind.body(ctx, job)), "worker": worker_name()}
            log.info("%s job succeeded", job.kind)
    except (JobCancelled, CollectionCancelled):
        ctx.jobs.update(job_id, status="cancelled", finished_at=utc_now())
    except TRANSIENT_ERRORS as exc:
        if not raise_transient:
            _fail(ctx, job_id, JobFailed(f"a service it needs was unavailable: {exc}").to_problem())
            return
        log.warning("job %s hit a transient error, to be retried: %s", job_id, exc)
        ctx.jobs.update(job_id, status="queued", persist=False)
        raise
    except ProblemError as exc:
        _fail(ctx, job_id, exc.to_problem())
    except Exception as exc:  # the job must end, and the user must read why
        ran_out = exhausted_memory(exc)  # past ENGRAM_JOB_MEMORY_BYTES: the input's cost, named as such
        log.error("job %s failed: %s", job_id, exc if ran_out else traceback.format_exc())
        _fail(ctx, job_id, out_of_memory_problem() if ran_out else _internal_problem(exc))
    else:
        ctx.jobs.update(job_id, status="succeeded", result=result, finished_at=utc_now())
    if ran_out:  # the failed job's objects are unreachable now (its traceback is gone): free them
        release_freed_memory()


def _internal_problem(exc: Exception) -> ProblemDetails:
    problem = JobFailed(f"{type(exc).__name__}: {exc}").to_problem()
    return problem.with_members(status=500, title="Internal error", type="https://engram.dev/problems/internal")


def stored_result(kind: Kind, name: str, returned: BaseModel | dict[str, Any]) -> dict[str, Any]:
    """A body's result as the job stores it: its kind's model, dumped once with the fields the body set.

    A body that returns a JSON object (none does today) has it validated as its kind's
    model first, so a field no kind declares or a value of the wrong type fails the job, naming it.
    """
    typed = kind.result.model_validate(returned) if isinstance(returned, dict) else returned
    if not isinstance(typed, kind.result):
        raise TypeError(f"the {name} job's body returned a {type(typed).__name__}, not a {kind.result.__name__}")
    return typed.model_dump(mode="json", exclude_unset=True)


def retry_after(ctx: Context, job_id: str, exc: Exception, retries: int, max_retries: int) -> int | None:
    """After a transient error (:data:`TRANSIENT_ERRORS`): the seconds before the job's next try,
    backing off exponentially (2, 4, 8, ... 60), or ``None`` when it had ``max_retries`` already:
    the job is then failed here, naming the error."""
    if retries >= max_retries:
        _fail(ctx, job_id, ServiceUnavailable(f"gave up after {retries} retries: {exc}").to_problem())
        return None
    return int(min(60, 2 ** (retries + 1)))


def run_helper(ctx: Context, kind: JobKind, subject_id: str, job_id: str) -> None:
    """Help job ``job_id`` of ``kind`` with ``subject_id`` (a universe it builds): run the kind's
    helper (:class:`~service.execution.kinds.Helper`) until it has nothing left to do, then stop.

    A helper is not a job: it has no record and its failure fails nothing. Whatever it could not do
    (it failed, or its worker died) its job does itself, and a job that ended or was cancelled
    stops its helpers at their next check (:class:`JobCancelled`).
    """
    with job_context(job_id):
        try:
            done = HELPERS[kind].body(ctx, subject_id, job_id)
        except JobCancelled:
            log.info("%s %s: stopped helping, job %s ended", kind, subject_id, job_id)
        except Exception as exc:  # the job redoes the work; say why here
            log.warning("%s %s: helper of job %s failed, the job takes over: %s", kind, subject_id, job_id, exc)
        else:
            log.info("%s %s: helper of job %s done (%s)", kind, subject_id, job_id, done)


@contextmanager
def _in_background(name: str, loop: Callable[[threading.Event], None]) -> Iterator[None]:
    """Run ``loop(stop)`` in a daemon thread while the body runs; set ``stop`` and join it after."""
    stop = threading.Event()
    thread = threading.Thread(target=loop, args=(stop,), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


@contextmanager
def _heartbeat(ctx: Context, job_id: str) -> Iterator[None]:
    """While the body runs, tell the reconciler this job's worker is alive (distributed mode)."""
    if not isinstance(ctx.jobs, RedisJobStore):  # embedded mode: the job process is the API's child
        yield
        return
    beat = ctx.jobs.heartbeat

    def loop(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                beat(job_id)
            except Exception as exc:  # Redis briefly away: the next beat may get through
                log.warning("heartbeat of job %s failed: %s", job_id, exc)
            stop.wait(max(1.0, ctx.settings.heartbeat_ttl_s / 4))

    with _in_background(f"heartbeat-{job_id}", loop):
        yield


_WATCH_S = 1.0  # how often the cancel watchdog reads the job


@contextmanager
def _cancel_watchdog(ctx: Context, job_id: str, stuck_cancel: Callable[[], None] | None) -> Iterator[None]:
    """While the body runs, call ``stuck_cancel`` once the job has ignored its cancellation for
    ENGRAM_CANCEL_GRACE_S (every phase checks it within a second or so; this catches the rest)."""
    if stuck_cancel is None:
        yield
        return

    def loop(stop: threading.Event) -> None:
        asked: float | None = None
        while not stop.wait(_WATCH_S):
            try:
                job = ctx.jobs.get(job_id)
            except Exception:  # Redis briefly away: look again at the next tick
                continue
            if job is None or not job.cancel_requested:
                continue
            asked = time.monotonic() if asked is None else asked
            if time.monotonic() - asked >= ctx.settings.cancel_grace_s and not stop.is_set():
                log.error("job %s ignored its cancellation for %gs: stopping it", job_id, ctx.settings.cancel_grace_s)
                stuck_cancel()
                return

    with _in_background(f"cancel-watchdog-{job_id}", loop):
        yield


def _fail(ctx: Context, job_id: str, problem: ProblemDetails) -> None:
    ctx.jobs.update(job_id, status="failed", error=problem, finished_at=utc_now())
