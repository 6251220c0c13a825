"""Where request handlers run, so that no kind of request can starve another.

- ``/healthz`` runs on the event loop itself and touches nothing: it answers while every thread is busy.
- Status reads (jobs, concepts, variants, models, ``/readyz``) run in a lane of their own threads,
  never in the shared pool that uploads and edit requests use; most are answered from memory
  (live job records, :mod:`service.storage.read_cache`), so a poll costs a thread hop at most.
- ``?wait=`` holds no thread: it sleeps on the event loop between cheap status reads. Waiters are
  capped per process (``ENGRAM_MAX_WAITERS``); one more is a 429 with ``Retry-After``, before
  anything is submitted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from service.context import Context
from service.errors import ProblemError
from service.jobs.records import JobRecord
from service.jobs.store import FINISHED

T = TypeVar("T")
STATUS_THREADS = 16
WAIT_RETRY_AFTER_S = 2
_POLL_FIRST_S, _POLL_MAX_S = 0.05, 0.5


class TooManyWaiters(ProblemError):
    status, title, slug = 429, "Too many waiting requests", "too-many-waiters"
    headers = {"Retry-After": str(WAIT_RETRY_AFTER_S)}


class Lanes:
    """The status thread lane and the waiter count of one app."""

    def __init__(self, max_waiters: int) -> None:
        self.max_waiters = max_waiters
        self.waiting = 0
        self._status: anyio.CapacityLimiter | None = None

    async def status(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a status read in the status lane."""
        if self._status is None:  # created inside the running loop
            self._status = anyio.CapacityLimiter(STATUS_THREADS)
        return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=self._status)

    def admit_waiter(self) -> None:
        """Count one more waiting request, or refuse it (429) when the cap is reached."""
        if self.waiting >= self.max_waiters:
            raise TooManyWaiters(
                f"{self.waiting} requests are already waiting for jobs (ENGRAM_MAX_WAITERS={self.max_waiters}); "
                f"retry in {WAIT_RETRY_AFTER_S} s, or submit without ?wait= and poll the job"
            )
        self.waiting += 1

    async def wait_for_job(self, ctx: Context, job: JobRecord, wait_s: float) -> JobRecord:
        """The job once finished or when ``wait_s`` is up, whichever comes first; releases the
        waiter slot :meth:`admit_waiter` took."""
        try:
            deadline, pause = time.monotonic() + wait_s, _POLL_FIRST_S
            while job.status not in FINISHED:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, _POLL_MAX_S)
                latest: JobRecord | None = await self.status(ctx.jobs.get, job.job_id)
                job = latest or job  # None: deleted meanwhile
            return job
        finally:
            self.waiting -= 1
