"""A running job's progress counter and its cancellation check (``service.jobs.progress``): ticks are
throttled to one a second but the last one is always written, every step checks cancellation, and a
phase restarts the count."""

from __future__ import annotations

import pytest

from service.context import Context
from service.jobs.progress import CancelOnly, JobCancelled, NoProgress, ProgressReporter
from service.jobs.store import new_job
from tests.helpers.jobs import payload_for


def progress_of(ctx: Context, job_id: str) -> dict[str, int | str]:
    job = ctx.jobs.get(job_id)
    assert job is not None
    return job.progress.model_dump()


@pytest.fixture
def job_id(ctx: Context) -> str:
    job = ctx.jobs.create(new_job("collect", payload_for("collect"), unit="tokens"))
    ctx.jobs.update(job.job_id, progress={**job.progress.model_dump(), "done": 5, "total": 5})  # a previous try's count
    return str(job.job_id)


def test_starting_counts_from_zero_towards_the_total_and_persists_it(ctx: Context, job_id: str) -> None:
    ProgressReporter(ctx, job_id, total=10)
    assert progress_of(ctx, job_id) == {"done": 0, "total": 10, "unit": "tokens"}
    assert ctx.storage.get_json(f"jobs/{job_id}.json")["progress"]["total"] == 10


def test_ticks_are_throttled_but_the_last_one_is_always_written(ctx: Context, job_id: str) -> None:
    progress = ProgressReporter(ctx, job_id, total=10)
    progress.advance()
    assert progress_of(ctx, job_id)["done"] == 1, "the first tick is written"
    progress.advance(3)
    assert progress_of(ctx, job_id)["done"] == 1, "within a second of the last: not written"
    assert progress.done == 4
    progress.advance(6)
    assert progress_of(ctx, job_id)["done"] == 10, "done: written whatever the time"


def test_a_tick_after_a_second_is_written(ctx: Context, job_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("service.jobs.progress.time.monotonic", lambda: clock[0])
    progress = ProgressReporter(ctx, job_id, total=100)
    progress.advance()
    clock[0] += 0.5
    progress.advance()
    assert progress_of(ctx, job_id)["done"] == 1
    clock[0] += 0.6
    progress.advance()
    assert progress_of(ctx, job_id)["done"] == 3


def test_every_step_checks_cancellation(ctx: Context, job_id: str) -> None:
    progress = ProgressReporter(ctx, job_id, total=10)
    progress.advance()
    ctx.jobs.update(job_id, cancel_requested=True)
    assert progress.cancelled()
    with pytest.raises(JobCancelled):
        progress.advance()  # throttled tick: the check runs all the same


def test_restart_counts_a_next_phase_from_zero(ctx: Context, job_id: str) -> None:
    progress = ProgressReporter(ctx, job_id, total=10)
    progress.advance(10)
    progress.restart(4)
    assert (progress.done, progress.total) == (0, 4)
    assert progress_of(ctx, job_id) == {"done": 0, "total": 4, "unit": "tokens"}
    progress.advance()
    assert progress_of(ctx, job_id)["done"] == 1, "the throttle restarts too"


def test_cancel_only_checks_without_counting(ctx: Context, job_id: str) -> None:
    progress = ProgressReporter(ctx, job_id, total=10)
    check = CancelOnly(progress)
    check.advance(5)
    assert progress.done == 0 and progress_of(ctx, job_id)["done"] == 0
    ctx.jobs.update(job_id, cancel_requested=True)
    with pytest.raises(JobCancelled):
        check.advance()


def test_no_progress_listens_to_nothing() -> None:
    NoProgress().advance(10**9)
