"""Job status, progress and cancellation."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api_schemas import Job
from service.api.deps import ContextDep
from service.errors import NotFound
from service.jobs import FINISHED, public_view, utc_now

router = APIRouter(tags=["jobs"])
job_view = public_view


def _job(ctx: Any, job_id: str) -> dict[str, Any]:
    job = ctx.jobs.get(job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist")
    return job


@router.get("/jobs/{job_id}", response_model=Job)
def get_job(job_id: str, ctx: ContextDep) -> dict[str, Any]:
    """A job's status and progress."""
    return job_view(_job(ctx, job_id))


@router.delete("/jobs/{job_id}", response_model=Job)
def cancel_job(job_id: str, ctx: ContextDep) -> dict[str, Any]:
    """Cancel a job: a queued one at once, a running one at its next checkpoint."""
    job = _job(ctx, job_id)
    if job["status"] in FINISHED:
        return job_view(job)
    if job["status"] == "queued":
        return job_view(ctx.jobs.update(job_id, cancel_requested=True, status="cancelled", finished_at=utc_now()))
    return job_view(ctx.jobs.update(job_id, cancel_requested=True))
