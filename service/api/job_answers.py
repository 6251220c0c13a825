"""Routes whose answer a job computes (a map, a registration): wait a little, then say where it stands.

The route submits (or finds) the job, waits up to the request's ``?wait=`` seconds for it, and
answers with the result when the job produced it; otherwise with :func:`unfinished_answer`: 202 and
the job (``Location`` to poll) while it runs, the job's problem once it failed or was cancelled.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from service.api.lanes import Lanes
from service.api.problems import PROBLEM_JSON
from service.context import Context
from service.errors import ProblemDetails
from service.jobs.records import JobRecord
from service.jobs.store import FINISHED, public_view

POLL_AFTER_S = 2  # Retry-After of a 202: a poll every two seconds is plenty for jobs of seconds to minutes


async def waited(ctx: Context, lanes: Lanes, job: JobRecord, wait_s: float) -> JobRecord:
    """The job once finished, or as it is after ``wait_s`` seconds (429 when too many requests wait
    already: the job runs anyway)."""
    if wait_s <= 0:
        return job
    lanes.admit_waiter()
    return await lanes.wait_for_job(ctx, job, wait_s)


def unfinished_answer(job: JobRecord, what: str) -> JSONResponse:
    """The answer when ``job`` has not produced ``what`` (``"this map"``): 202 with the job while it
    runs; once it ended, its problem (failed), or a 409 saying to ask again (cancelled, or its result
    gone since), with the job's ID."""
    if job.status not in FINISHED:
        headers = {"Location": f"/jobs/{job.job_id}", "Retry-After": str(POLL_AFTER_S)}
        view = public_view(job).model_dump(mode="json")
        return JSONResponse(view, status_code=202, headers=headers)
    problem = job.error or ProblemDetails(
        type="https://engram.dev/problems/job-cancelled",
        title="Job cancelled" if job.status == "cancelled" else "Result gone",
        status=409,
        detail=f"the job for {what}, {job.job_id}, was {job.status} without it: ask again to start another",
    )
    answer = problem.with_members(job_id=job.job_id).model_dump(mode="json")
    return JSONResponse(answer, status_code=problem.status, media_type=PROBLEM_JSON)
