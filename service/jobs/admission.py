"""Admission control: a bound on unfinished jobs in total and per API key.

A request that would start jobs asks :func:`admit` first, under ``ctx.lock`` and before it writes
anything, so that a refusal (429 with ``Retry-After``) leaves no job record, no concept record and
no dataset behind, and so that two requests cannot both take the last slot (the lock is shared by
every API process in distributed mode). Work answered from what exists (a stored result, a job
already queued or running for the same request) starts no job and is never refused.

Who owns a job: the API key of the request that submits it (``key#N``, never the key itself), or
:data:`ANONYMOUS` when auth is off, one key for every caller. The API sets :data:`job_owner` for
each request; jobs that a job submits itself (a calibration's recommended variant) have no owner
and are admitted with the work that started them.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol

from service.config import Settings
from service.errors import ProblemError

ANONYMOUS = "anonymous"
# Jobs take seconds to minutes: a retry sooner than this would mostly be refused again.
RETRY_AFTER_S = 30

job_owner: ContextVar[str | None] = ContextVar("engram_job_owner", default=None)


class _Counting(Protocol):
    def open_counts(self, owner: str, *, exact: bool = False) -> tuple[int, int]: ...


class _Admitting(Protocol):
    """What :func:`admit` reads of a :class:`service.context.Context` (which imports the job store,
    which imports this module: a Protocol keeps the import one way)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def jobs(self) -> _Counting: ...


class TooManyJobs(ProblemError):
    status, title, slug = 429, "Too many jobs", "too-many-jobs"
    headers = {"Retry-After": str(RETRY_AFTER_S)}


def admit(ctx: _Admitting, count: int = 1) -> None:
    """Admit ``count`` new jobs of the current request's owner, or refuse them all.

    Call under ``ctx.lock``, before anything is written, with the number of jobs the request
    would create (0: it starts none, and is admitted whatever the counts).

    Raises:
        TooManyJobs: the owner's unfinished jobs plus ``count`` would exceed
            ``ENGRAM_MAX_QUEUED_JOBS_PER_KEY``, or everyone's ``ENGRAM_MAX_QUEUED_JOBS``.
    """
    owner = job_owner.get()
    if owner is None or count <= 0:
        return
    settings = ctx.settings
    total, mine = ctx.jobs.open_counts(owner)
    if _fits(total, mine, count, settings.max_queued_jobs, settings.max_queued_jobs_per_key):
        return
    total, mine = ctx.jobs.open_counts(owner, exact=True)  # a count that drifted must not refuse anyone
    if mine + count > settings.max_queued_jobs_per_key:
        raise TooManyJobs(
            f"this API key has {mine} jobs queued or running, and this request would add {count}: at most "
            f"{settings.max_queued_jobs_per_key} per key (ENGRAM_MAX_QUEUED_JOBS_PER_KEY). Nothing was submitted; "
            f"retry after {RETRY_AFTER_S} s, once some have finished (GET /jobs lists them)"
        )
    if total + count > settings.max_queued_jobs:
        raise TooManyJobs(
            f"the service has {total} jobs queued or running, and this request would add {count}: at most "
            f"{settings.max_queued_jobs} in total (ENGRAM_MAX_QUEUED_JOBS). Nothing was submitted; "
            f"retry after {RETRY_AFTER_S} s"
        )


def _fits(total: int, mine: int, count: int, max_total: int, max_per_key: int) -> bool:
    return total + count <= max_total and mine + count <= max_per_key
