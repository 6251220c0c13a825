"""What a domain's service does with a job that exists already: a repeated request follows it.

A request that finds its work queued, running or done (the same concept, variant, universe,
calibration, evaluation or generation posted again) adds its callback URLs to that job instead of
starting another, and is never refused by admission control: it adds no work.
"""

from __future__ import annotations

from collections.abc import Callable

from service.jobs import callbacks
from service.jobs.admission import admit
from service.jobs.ports import JobsContext
from service.jobs.records import JobRecord
from service.jobs.store import FINISHED


def attach_callbacks(ctx: JobsContext, job: JobRecord, urls: list[str]) -> JobRecord:
    """Add callback URLs to an existing job; a job that already ended calls them back at once."""
    new_urls = tuple(u for u in urls if u not in job.callbacks)
    if not new_urls:
        return job
    job = ctx.jobs.update(job.job_id, persist=False, callbacks=(*job.callbacks, *new_urls))
    if job.status in FINISHED:
        callbacks.enqueue(ctx.storage, job, new_urls)
        if ctx.jobs.on_finished is not None:
            ctx.jobs.on_finished()
    else:
        ctx.jobs.update(job.job_id)  # persist now: the outbox entry is written when it ends
    return job


def _never(job: JobRecord) -> bool:
    return False


def follow_or_start(
    ctx: JobsContext,
    request_key: str,
    start: Callable[[], JobRecord],
    urls: list[str],
    *,
    answers: Callable[[JobRecord], bool] = _never,
    prepare: Callable[[], None] | None = None,
) -> JobRecord:
    """The job of a request identified by ``request_key`` (a content address of everything that
    determines its result): the one queued or running for it, else a new one.

    ``request_key`` holds ``{"job_id"}`` of the last job started for the request. Under
    ``ctx.lock`` (every API process's in distributed mode), so that concurrent identical requests
    start one job: the first is admitted and starts it, the others follow it and are never refused.

    Args:
        start: the new job record (not yet created), called only when one is started.
        urls: the request's callback URLs, added to a followed job.
        answers: whether a finished job still answers the request (a succeeded job whose result is
            stored by content); a failed or cancelled one never does.
        prepare: what the job reads, written after admission and before the job exists.

    Raises:
        TooManyJobs: a new job is needed and would exceed a bound on queued jobs (nothing written).
    """
    with ctx.lock:
        followed = _followed(ctx, request_key, answers)
        if followed is not None:
            return attach_callbacks(ctx, followed, urls)
        admit(ctx)  # before anything is written: a refusal leaves no trace
        if prepare is not None:
            prepare()
        job = ctx.jobs.create(start())
        ctx.storage.put_json(request_key, {"job_id": job.job_id})
    ctx.dispatch(job)  # enqueued only after what it reads is saved
    return ctx.jobs.get(job.job_id) or job


def _followed(ctx: JobsContext, request_key: str, answers: Callable[[JobRecord], bool]) -> JobRecord | None:
    """The job recorded for the request when it is queued or running, or finished and still answers it."""
    stored = ctx.storage.find_json(request_key)
    job_id = stored.get("job_id") if isinstance(stored, dict) else None
    job = ctx.jobs.readable(job_id) if isinstance(job_id, str) else None  # a damaged record: start anew
    if job is None or job.status in {"failed", "cancelled"}:
        return None
    return job if job.status not in FINISHED or answers(job) else None
