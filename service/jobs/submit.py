"""What a domain's service does with a job that exists already: a repeated request follows it.

A request that finds its work queued, running or done (the same concept, variant, universe or
calibration posted again) adds its callback URLs to that job instead of starting another.
"""

from __future__ import annotations

from typing import Any

from service.context import Context
from service.jobs import callbacks
from service.jobs.store import FINISHED


def attach_callbacks(ctx: Context, job: dict[str, Any], urls: list[str]) -> dict[str, Any]:
    """Add callback URLs to an existing job; a job that already ended calls them back at once."""
    new_urls = [u for u in urls if u not in (job.get("callbacks") or [])]
    if not new_urls:
        return job
    job = ctx.jobs.update(job["job_id"], persist=False, callbacks=[*(job.get("callbacks") or []), *new_urls])
    if job["status"] in FINISHED:
        callbacks.enqueue(ctx.storage, {**job, "callbacks": new_urls})
        if ctx.jobs.on_finished is not None:
            ctx.jobs.on_finished()
    else:
        ctx.jobs.update(job["job_id"])  # persist now: the outbox entry is written when it ends
    return job
