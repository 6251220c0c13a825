"""What a domain's service does with a job that exists already: a repeated request follows it.

A request that finds its work queued, running or done (the same concept, variant, universe or
calibration posted again) adds its callback URLs to that job instead of starting another.
"""

from __future__ import annotations

from service.context import Context
from service.jobs import callbacks
from service.jobs.records import JobRecord
from service.jobs.store import FINISHED


def attach_callbacks(ctx: Context, job: JobRecord, urls: list[str]) -> JobRecord:
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
