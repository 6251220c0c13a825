"""A job record in storage that is not a JSON object stops no pass over the open jobs (issue 35,
finding 10): distributed mode's ``GET /jobs`` (:meth:`RedisJobStore.active`, from the open markers),
the reconciler and embedded mode's restart (:meth:`JobStore.unfinished`) leave it out with a
warning naming its key, and reading it by ID is the 503 :class:`UnreadableJobRecord` naming the job
and why. Before, a truncated or non-UTF-8 record was silently read as no job at all, and one nested
past the recursion limit raised out of every pass (a 500 for every caller, a process that could not
start). Real Redis (``tests.helpers.redis``) and local storage.
"""

from __future__ import annotations

import logging

import pytest
import redis

from service.context import Context
from service.jobs.records import UnreadableJobRecord
from service.jobs.store import JobStore, RedisJobStore, new_job
from service.storage.keys import OPEN_JOBS, job_key
from tests.helpers.jobs import payload_for

BAD_ID = "b" * 32
FORMS = {
    "array": (b'["a", "job"]', "JSON array, not an object"),
    "number": (b"7", "JSON number, not an object"),
    "non-utf8": (b'{"job_id": "\xff"}', "not UTF-8"),
    "deep": (b'{"job_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "truncated": (b'{"job_id": "bbbb', "not JSON"),
}


def with_a_bad_open_job(ctx: Context, form: str) -> str:
    """A good open job and a bad one (its record in ``form``, its open marker); the good one's ID."""
    good = ctx.jobs.create(new_job("map", payload_for("map"), unit="layers")).job_id
    ctx.storage.put_bytes(job_key(BAD_ID), FORMS[form][0])
    ctx.storage.put_bytes(OPEN_JOBS + BAD_ID, b"")
    return good


@pytest.mark.parametrize("form", sorted(FORMS))
def test_redis_active_jobs_leave_an_unreadable_record_out_and_name_it(
    redis_ctx: Context, client: redis.Redis, form: str, caplog: pytest.LogCaptureFixture
) -> None:
    good = with_a_bad_open_job(redis_ctx, form)
    caplog.set_level(logging.WARNING, logger="engram")
    assert [j.job_id for j in redis_ctx.jobs.active()] == [good]
    assert job_key(BAD_ID) in {getattr(r, "record_key", None) for r in caplog.records}
    other = RedisJobStore(redis_ctx.storage, client, heartbeat_ttl_s=2)  # another process: reads storage
    with pytest.raises(UnreadableJobRecord, match=f"job {BAD_ID} cannot be read: .*{FORMS[form][1]}") as refused:
        other.get(BAD_ID)
    assert refused.value.status == 503


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_restarted_process_finds_its_unfinished_jobs_past_an_unreadable_one(ctx: Context, form: str) -> None:
    good = with_a_bad_open_job(ctx, form)
    restarted = JobStore(ctx.storage)
    assert [j.job_id for j in restarted.unfinished()] == [good]
    with pytest.raises(UnreadableJobRecord, match=FORMS[form][1]):
        restarted.get(BAD_ID)
