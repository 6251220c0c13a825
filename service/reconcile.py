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
import threading
from collections.abc import Callable
from typing import Any

from service.jobs import FINISHED, OPEN_PREFIX, RedisJobStore, utc_now
from service.storage import StorageUnavailable

log = logging.getLogger("engram.reconcile")


def reconcile_once(jobs: RedisJobStore, dispatch: Callable[[dict[str, Any]], None]) -> list[str]:
    """One pass over the open jobs; returns the IDs dispatched again."""
    epoch = jobs.epoch()
    redispatched = []
    for key in jobs.storage.list(OPEN_PREFIX):
        job_id = key.removeprefix(OPEN_PREFIX)
        job = jobs.get(job_id)
        if job is None:
            continue
        reason = _why_lost(jobs, job, epoch)
        if job["status"] in FINISHED:
            jobs.update(job_id)  # its last persist failed: persisting now also drops the open marker
        elif job["cancel_requested"] and job["status"] == "queued" and reason:
            jobs.update(job_id, status="cancelled", finished_at=utc_now())
        elif reason:
            log.warning("re-dispatching job %s: %s", job_id, reason)
            dispatch(jobs.update(job_id, status="queued"))
            redispatched.append(job_id)
    return redispatched


def _why_lost(jobs: RedisJobStore, job: dict[str, Any], epoch: str) -> str | None:
    """Why nobody will run this unfinished job unless it is dispatched again, or None."""
    if not jobs.is_live(job["job_id"]):
        return "Redis lost its record"
    if job["status"] == "running" and not jobs.alive(job["job_id"]):
        return "its worker stopped sending heartbeats"
    if job["status"] == "queued" and job.get("dispatch_epoch") != epoch:
        return "its message was queued in a Redis that has since restarted"
    return None


class Reconciler:
    """A daemon thread running :func:`reconcile_once` under a Redis lock."""

    def __init__(self, jobs: RedisJobStore, dispatch: Callable[[dict[str, Any]], None], interval_s: float) -> None:
        self.jobs, self.dispatch, self.interval_s = jobs, dispatch, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engram-reconciler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            lock = self.jobs.redis.lock("engram:lock:reconcile", timeout=max(30, 4 * self.interval_s))
            try:
                if lock.acquire(blocking=False):
                    try:
                        reconcile_once(self.jobs, self.dispatch)
                    finally:
                        lock.release()
            except (StorageUnavailable, OSError) as exc:
                log.warning("reconcile pass skipped: %s", exc)
            except Exception:
                log.exception("reconcile pass failed")
