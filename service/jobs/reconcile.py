"""Distributed mode's safety net: no job stays queued or running forever.

Every ``reconcile_interval_s`` one API process (a Redis lock elects it) walks the open jobs, whose
markers are in object storage and so survive anything Redis forgets:

- Redis lost the record (it restarted with no persistence, and the queued message with it):
  restore the record from storage and dispatch the job again;
- a running job's heartbeat expired (its worker died): dispatch it again;
- a finished job whose final state never reached storage (S3 was down): persist it now.

Tasks are idempotent and their outputs content-addressed, so a job dispatched twice is harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from service.jobs.periodic import PeriodicDuty
from service.jobs.records import JobRecord
from service.jobs.store import FINISHED, RedisJobStore, utc_now

log = logging.getLogger("engram.reconcile")


def reconcile_once(jobs: RedisJobStore, dispatch: Callable[[JobRecord], None]) -> list[str]:
    """One pass over the open jobs; returns the IDs dispatched again."""
    epoch = jobs.epoch()
    redispatched = []
    for job in jobs.marked_open():  # an unreadable record is logged by name, and stops no other
        job_id = job.job_id
        reason = _why_lost(jobs, job, epoch)
        if job.status in FINISHED:
            jobs.update(job_id)  # its last persist failed: persisting now also drops the open marker
        elif job.cancel_requested and job.status == "queued" and reason:
            jobs.update(job_id, expect=("queued",), status="cancelled", finished_at=utc_now())
        elif reason:
            # Compare-and-set on the status it was judged in: a job that ended since (its worker was
            # only slow) keeps its end, and is not dispatched again.
            requeued = jobs.update(job_id, expect=(job.status,), status="queued")
            if requeued.status != "queued":
                continue
            log.warning("re-dispatching job %s: %s", job_id, reason)
            dispatch(requeued)
            redispatched.append(job_id)
    return redispatched


def _why_lost(jobs: RedisJobStore, job: JobRecord, epoch: str) -> str | None:
    """Why nobody will run this unfinished job unless it is dispatched again, or None."""
    if not jobs.is_live(job.job_id):
        return "Redis lost its record"
    if job.status == "running" and not jobs.alive(job.job_id):
        return "its worker stopped sending heartbeats"
    if job.status == "queued" and job.dispatch_epoch != epoch:
        return "its message was queued in a Redis that has since restarted"
    return None


def reconciler(jobs: RedisJobStore, dispatch: Callable[[JobRecord], None], interval_s: float) -> PeriodicDuty:
    """:func:`reconcile_once` every ``interval_s``, in one API process at a time (a Redis lock)."""

    def lock() -> Any:
        return jobs.redis.lock("engram:lock:reconcile", timeout=max(30, 4 * interval_s))

    return PeriodicDuty("reconciler", lambda: reconcile_once(jobs, dispatch), interval_s, lock)
