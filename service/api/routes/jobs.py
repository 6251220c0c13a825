"""Job status, progress and cancellation, and the history of every job run."""

from __future__ import annotations

import re
from collections.abc import Collection
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from api_schemas import Job
from service.api.deps import ContextDep, LanesDep
from service.api.pagination import PAGED_HEADERS, PageDep, SortKey
from service.errors import NotFound
from service.jobs.records import JobKind, JobRecord
from service.jobs.store import FINISHED, job_answer, utc_now

router = APIRouter(tags=["jobs"])
job_view = job_answer

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
UNFINISHED = ("queued", "running")
_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _iso_time(value: object) -> object:
    """Refuse what pydantic's lax datetime would read as a Unix time (``0.5``, ``1700000000``): a
    time is asked for as ISO 8601, and a number is far more often a mistake than an epoch."""
    if isinstance(value, str) and not _ISO_DATE.match(value):
        raise ValueError("expected an ISO 8601 time such as 2026-11-29T08:00:00Z (UTC when no zone is given)")
    return value


IsoTime = Annotated[datetime, BeforeValidator(_iso_time)]
_STATUS = Query(
    description="only jobs in these states (repeat it); default queued and running. A finished state "
    "(succeeded, failed, cancelled) browses every job ever run: one storage read per job"
)


def _job(ctx: Any, job_id: str) -> JobRecord:
    job = ctx.jobs.get(job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist")
    return job


@router.get("/jobs", response_model=list[Job], responses=PAGED_HEADERS)
async def list_jobs(
    ctx: ContextDep,
    lanes: LanesDep,
    page: PageDep,
    status: Annotated[list[JobStatus] | None, _STATUS] = None,
    kind: Annotated[list[JobKind] | None, Query(description="only jobs of these kinds (repeat it)")] = None,
    created_after: Annotated[IsoTime | None, Query(description="only jobs created at or after this time")] = None,
    created_before: Annotated[IsoTime | None, Query(description="only jobs created before this time")] = None,
) -> list[Job]:
    """Jobs oldest first (by creation, then ID), one page (``limit``, ``cursor``). Without ``status``:
    those not finished yet (queued or running), what the service is working on. Finished jobs are
    kept for good in storage (``jobs/<id>.json``), so ``status=succeeded`` (or failed, cancelled)
    lists the whole history, filtered by ``kind`` and creation time."""
    wanted = set(status or UNFINISHED)
    source = ctx.jobs.active if wanted <= set(UNFINISHED) else ctx.jobs.recorded
    after, before = _utc(created_after), _utc(created_before)
    jobs: dict[SortKey, JobRecord] = {
        (j.created_at, j.job_id): j
        for j in await lanes.status(source)
        if j.status in wanted and _kept(j, kind, after, before)
    }
    items, next_key = page.select(sorted(jobs), lambda key: job_view(jobs[key]))
    return page.answer(items, next_key)


def _kept(job: JobRecord, kinds: Collection[str] | None, after: datetime | None, before: datetime | None) -> bool:
    if kinds and job.kind not in kinds:
        return False
    created = datetime.fromisoformat(job.created_at)
    return (after is None or created >= after) and (before is None or created < before)


def _utc(moment: datetime | None) -> datetime | None:
    """A time without a zone is UTC (every job's ``created_at`` has one)."""
    return moment if moment is None or moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


@router.get("/jobs/{job_id}", response_model=Job)
async def get_job(job_id: str, ctx: ContextDep, lanes: LanesDep) -> Job:
    """A job's status and progress."""
    return job_view(await lanes.status(_job, ctx, job_id))


@router.delete("/jobs/{job_id}", response_model=Job)
def cancel_job(job_id: str, ctx: ContextDep) -> Job:
    """Cancel a job: a queued one at once, a running one at its next checkpoint."""
    job = _job(ctx, job_id)
    if job.status in FINISHED:
        return job_view(job)
    if job.status == "queued":
        # Compare-and-set: a job that started since is cancelled at its next checkpoint instead.
        job = ctx.jobs.update(job_id, expect=("queued",), cancel_requested=True, status="cancelled", finished_at=utc_now())
        if job.status in FINISHED:
            return job_view(job)
    return job_view(ctx.jobs.update(job_id, cancel_requested=True))
