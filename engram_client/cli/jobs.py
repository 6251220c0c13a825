"""``engram jobs list | watch | show | cancel``: any job by its ID, whichever command started it.

The exit code of ``watch`` is the job's outcome (0 succeeded, 1 failed or cancelled), so a script
can wait for a job it submitted with ``--no-wait``.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from engram_client.cli.options import CursorOpt, JsonFlag, LimitOpt
from engram_client.cli.output import emit, job_failed, note_next_page, stderr
from engram_client.cli.progress import watch
from engram_client.cli.render import render_job, render_jobs
from engram_client.cli.root import session
from engram_client.client import FINISHED

jobs_app = typer.Typer(help="Watch, inspect and cancel jobs.", no_args_is_help=True)


class Unfinished(str, Enum):
    queued = "queued"
    running = "running"


@jobs_app.command("list")
def jobs_list(
    ctx: typer.Context,
    status: Annotated[
        list[Unfinished] | None, typer.Option("--status", help="Only jobs in this state (repeat; default: both).")
    ] = None,
    limit: LimitOpt = None,
    cursor: CursorOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """The jobs not finished yet (queued or running), oldest first: what the service is working on
    (every page unless --limit/--cursor)."""
    with session(ctx) as client:
        jobs = client.list_jobs([s.value for s in status] if status else None, limit=limit, cursor=cursor)
    emit(ctx, as_json, jobs, lambda: render_jobs(jobs))
    note_next_page(jobs.next_cursor)


@jobs_app.command("watch")
def jobs_watch(ctx: typer.Context, job_id: str, as_json: JsonFlag = False) -> None:
    """Show a job's progress until it ends; exit 0 when it succeeded, 1 when it failed or was cancelled."""
    with session(ctx) as client:
        job = watch(client, [job_id])[0]
    emit(ctx, as_json, job, lambda: render_job(job))
    if job.status != "succeeded":
        job_failed(job)


@jobs_app.command("show")
def jobs_show(ctx: typer.Context, job_id: str, as_json: JsonFlag = False) -> None:
    """A job's status and progress."""
    with session(ctx) as client:
        job = client.get_job(job_id)
    emit(ctx, as_json, job, lambda: render_job(job))


@jobs_app.command("cancel")
def jobs_cancel(ctx: typer.Context, job_id: str, as_json: JsonFlag = False) -> None:
    """Cancel a job: a queued one at once, a running one at its next checkpoint."""
    with session(ctx) as client:
        job = client.cancel_job(job_id)
    if job.status not in FINISHED:
        stderr.print(f"cancellation of job {job_id} requested; it stops at its next checkpoint")
    emit(ctx, as_json, job, lambda: render_job(job))
