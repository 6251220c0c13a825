"""Admission control's arithmetic (``service.jobs.admission.admit``) on real job stores: the per-key
and total bounds, who is never counted, and a drifted count that must not refuse anyone.

(Live: 429 answers that store nothing, ``tests/api/test_admission.py``; the Redis counts themselves
are tested there too.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from service.context import Context
from service.jobs.admission import ANONYMOUS, RETRY_AFTER_S, TooManyJobs, admit, job_owner
from service.jobs.store import new_job
from tests.helpers.jobs import payload_for


@pytest.fixture
def as_owner() -> Iterator[Callable[[str | None], None]]:
    tokens = []

    def become(owner: str | None) -> None:
        tokens.append(job_owner.set(owner))

    yield become
    for token in reversed(tokens):
        job_owner.reset(token)


def fill(ctx: Context, count: int) -> list[str]:
    return [ctx.jobs.create(new_job("map", payload_for("map"), unit="layers")).job_id for _ in range(count)]


def test_a_key_is_admitted_up_to_its_bound_and_refused_past_it(
    context_with: Callable[..., Context], as_owner: Callable[[str | None], None]
) -> None:
    ctx = context_with(max_queued_jobs=100, max_queued_jobs_per_key=3)
    as_owner("key#1")
    admit(ctx, 3)
    fill(ctx, 2)
    admit(ctx, 1)
    with pytest.raises(TooManyJobs) as refused:
        admit(ctx, 2)
    problem = refused.value.to_problem().model_dump()
    assert problem["status"] == 429
    assert refused.value.headers == {"Retry-After": str(RETRY_AFTER_S)}
    for mention in ("2 jobs queued or running", "would add 2", "ENGRAM_MAX_QUEUED_JOBS_PER_KEY", "Nothing was submitted"):
        assert mention in problem["detail"]
    as_owner("key#2")
    admit(ctx, 3)  # another key's jobs do not count against this one


def test_everyone_together_is_bounded_too(
    context_with: Callable[..., Context], as_owner: Callable[[str | None], None]
) -> None:
    ctx = context_with(max_queued_jobs=4, max_queued_jobs_per_key=4)
    as_owner("key#1")
    fill(ctx, 2)
    as_owner("key#2")
    fill(ctx, 1)
    admit(ctx, 1)
    with pytest.raises(TooManyJobs) as refused:
        admit(ctx, 2)
    assert "the service has 3 jobs" in refused.value.detail and "ENGRAM_MAX_QUEUED_JOBS)" in refused.value.detail


def test_finished_jobs_free_their_slots(
    context_with: Callable[..., Context], as_owner: Callable[[str | None], None]
) -> None:
    ctx = context_with(max_queued_jobs_per_key=2)
    as_owner(ANONYMOUS)
    first, second = fill(ctx, 2)
    with pytest.raises(TooManyJobs):
        admit(ctx)
    ctx.jobs.update(first, status="succeeded")
    admit(ctx)
    ctx.jobs.update(second, status="running")
    with pytest.raises(TooManyJobs):
        admit(ctx, 2)


def test_work_that_starts_no_job_or_has_no_owner_is_never_refused(
    context_with: Callable[..., Context], as_owner: Callable[[str | None], None]
) -> None:
    ctx = context_with(max_queued_jobs=1, max_queued_jobs_per_key=1)
    as_owner("key#1")
    fill(ctx, 1)
    admit(ctx, 0)  # answered from what exists
    as_owner(None)  # a job's own follow-up work
    admit(ctx, 5)


def test_a_count_that_drifted_is_recounted_before_anyone_is_refused(
    context_with: Callable[..., Context], client: redis.Redis, as_owner: Callable[[str | None], None]
) -> None:
    """A process that died between finishing a job and saying so leaves the job in Redis' open sets:
    the fast count says full, the exact count says there is room."""
    redis_ctx = context_with(client, max_queued_jobs_per_key=2)
    as_owner("key#1")
    first, _ = fill(redis_ctx, 2)
    raw = client.get(f"engram:job:{first}")
    assert raw is not None
    client.set(f"engram:job:{first}", raw.replace(b'"queued"', b'"succeeded"'))  # finished, sets not told
    assert redis_ctx.jobs.open_counts("key#1") == (2, 2)
    admit(redis_ctx)
    assert redis_ctx.jobs.open_counts("key#1") == (1, 1)
