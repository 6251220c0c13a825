"""Job status, progress and cancellation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from api_schemas import Job
from service.api.deps import ContextDep, LanesDep
from service.api.pagination import PAGED_HEADERS, PageDep, SortKey
from service.errors import NotFound
from service.jobs.records import JobRecord
from service.jobs.store import FINISHED, job_answer, utc_now

router = APIRouter(tags=["jobs"])
job_view = job_answer


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
    status: Annotated[list[Literal["queued", "running"]] | None, Query(description="only jobs in these states")] = None,
) -> list[Job]:
    """Jobs not finished yet (queued or running), oldest first (by creation, then ID): what the service
    is working on, one page (``limit``, ``cursor``)."""
    wanted = set(status or ("queued", "running"))
    jobs: dict[SortKey, JobRecord] = {
        (j.created_at, j.job_id): j for j in await lanes.status(ctx.jobs.active) if j.status in wanted
    }
    items, next_key = page.select(sorted(jobs), lambda key: job_view(jobs[key]))
    return page.answer(items, next_key)


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
