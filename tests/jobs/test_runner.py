"""The state machine every job goes through (``service.execution.runner``), in this process.

``queued`` → ``running`` → ``succeeded`` | ``failed`` | ``cancelled``; a transient error puts the
job back to ``queued`` for a retry until :func:`retry_after` says it had its tries. What a cancel
does in each state is the API's ``DELETE /jobs/{id}`` (called here as a function, on the same
Context): a queued job ends at once, a running one at its body's next check, a finished one is left
as it was.

The bodies are small functions of this module, put in the kinds table in place of a domain's body
(a test double for work that would load a model); everything else, the store and the storage
included, is the real thing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from pydantic import BaseModel, ConfigDict

from service.api.routes.jobs import cancel_job
from service.context import Context
from service.errors import InvalidInput
from service.execution import kinds
from service.execution.runner import TRANSIENT_ERRORS, retry_after, run_helper, run_job
from service.jobs.leases import worker_name
from service.jobs.progress import JobCancelled, ProgressReporter
from service.jobs.records import JobRecord
from service.jobs.store import RedisJobStore, new_job
from service.storage.base import StorageUnavailable
from service.storage.keys import OPEN_JOBS, job_key
from tests.helpers.jobs import payload_for

Body = Callable[[Any, dict[str, Any]], dict[str, Any]]


class StubResult(BaseModel):
    """A stub body's result: any JSON object (a real kind's model names its fields)."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True)
class StubKind:
    """What the runner reads of a :class:`service.execution.kinds.Kind`: its body and its result's model."""

    body: Body
    result: type[BaseModel] = StubResult


@pytest.fixture
def use_body(monkeypatch: pytest.MonkeyPatch) -> Callable[[Body], None]:
    """Run ``body`` for jobs of kind ``map`` (the runner reads the same table object)."""

    def install(body: Body) -> None:
        monkeypatch.setitem(kinds.KINDS, "map", StubKind(body))

    return install


def submit(ctx: Context, **payload: Any) -> str:
    return ctx.jobs.create(new_job("map", payload_for("map", **payload), unit="steps")).job_id


def job(ctx: Context, job_id: str) -> JobRecord:
    found = ctx.jobs.get(job_id)
    assert found is not None
    return found


def is_open(ctx: Context, job_id: str) -> bool:
    return ctx.storage.exists(OPEN_JOBS + job_id)


# ---------------------------------------------------------------- outcomes


def test_a_body_that_returns_succeeds_with_its_result_and_the_worker(ctx: Context, use_body: Any) -> None:
    seen: list[dict[str, Any]] = []

    def body(c: Context, j: dict[str, Any]) -> dict[str, Any]:
        seen.append(job(c, j.job_id))
        return {"answer": 42}

    use_body(body)
    job_id = submit(ctx, model_id="m")
    run_job(ctx, job_id)
    assert [s.status for s in seen] == ["running"] and seen[0].started_at is not None
    done = job(ctx, job_id)
    assert done.status == "succeeded" and done.error is None
    assert done.result == {"answer": 42, "worker": worker_name()}
    assert done.started_at <= done.finished_at
    assert ctx.storage.get_json(job_key(job_id)) == done.model_dump(mode="json") and not is_open(ctx, job_id)


def test_a_problem_raised_by_the_body_fails_the_job_with_that_problem(ctx: Context, use_body: Any) -> None:
    def body(c: Context, j: dict[str, Any]) -> dict[str, Any]:
        raise InvalidInput("layer 'x' does not exist: pick one of GET /models/m's layers")

    use_body(body)
    job_id = submit(ctx)
    run_job(ctx, job_id)
    failed = job(ctx, job_id)
    assert failed.status == "failed" and failed.result is None and failed.finished_at
    assert failed.error == InvalidInput("layer 'x' does not exist: pick one of GET /models/m's layers").to_problem()
    assert not is_open(ctx, job_id)


def test_an_unexpected_error_fails_the_job_as_internal_naming_it(ctx: Context, use_body: Any) -> None:
    def body(c: Context, j: dict[str, Any]) -> dict[str, Any]:
        raise ZeroDivisionError("the body divided by zero")

    use_body(body)
    job_id = submit(ctx)
    run_job(ctx, job_id)
    error = job(ctx, job_id).error
    assert error is not None
    assert job(ctx, job_id).status == "failed"
    assert error.status == 500 and error.title == "Internal error"
    assert error.type == "https://engram.dev/problems/internal"
    assert "ZeroDivisionError: the body divided by zero" in error.detail


@pytest.mark.parametrize("transient", TRANSIENT_ERRORS)
def test_a_transient_error_fails_the_job_in_embedded_mode(ctx: Context, use_body: Any, transient: type[Exception]) -> None:
    """No queue retries it there: the job must end, saying what was unavailable."""

    def body(c: Context, j: dict[str, Any]) -> dict[str, Any]:
        raise transient("the store is away")

    use_body(body)
    job_id = submit(ctx)
    run_job(ctx, job_id)
    failed = job(ctx, job_id)
    assert failed.status == "failed"
    assert "a service it needs was unavailable: the store is away" in failed.error.detail


def test_a_transient_error_puts_the_job_back_in_the_queue_for_its_retry(ctx: Context, use_body: Any) -> None:
    calls: list[int] = []

    def body(c: Context, j: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 1:
            raise StorageUnavailable("S3 is down")
        return {"try": len(calls)}

    use_body(body)
    job_id = submit(ctx)
    with pytest.raises(StorageUnavailable):
        run_job(ctx, job_id, raise_transient=True)
    assert job(ctx, job_id).status == "queued" and is_open(ctx, job_id)
    run_job(ctx, job_id, raise_transient=True)  # Celery's retry
    assert job(ctx, job_id).status == "succeeded" and job(ctx, job_id).result["try"] == 2


def test_retries_back_off_exponentially_up_to_a_minute_then_fail_the_job(ctx: Context) -> None:
    job_id = submit(ctx)
    error = StorageUnavailable("S3 is down")
    assert [retry_after(ctx, job_id, error, n, max_retries=9) for n in range(9)] == [2, 4, 8, 16, 32, 60, 60, 60, 60]
    assert job(ctx, job_id).status == "queued", "a retry is not an outcome"
    assert retry_after(ctx, job_id, error, 9, max_retries=9) is None
    failed = job(ctx, job_id)
    assert failed.status == "failed" and not is_open(ctx, job_id)
    assert failed.error.status == 503 and failed.error.detail == "gave up after 9 retries: S3 is down"


def test_a_finished_job_delivered_again_is_left_alone(ctx: Context, use_body: Any) -> None:
    calls: list[int] = []
    use_body(lambda c, j: calls.append(1) or {})
    job_id = submit(ctx)
    run_job(ctx, job_id)
    first = job(ctx, job_id)
    run_job(ctx, job_id)
    assert calls == [1] and job(ctx, job_id) == first
    run_job(ctx, "c" * 32)  # a job nobody knows: nothing to run, no error


# ---------------------------------------------------------------- a cancel in each state


def test_cancelling_a_queued_job_ends_it_at_once_and_its_run_never_starts(ctx: Context, use_body: Any) -> None:
    calls: list[int] = []
    use_body(lambda c, j: calls.append(1) or {})
    job_id = submit(ctx)
    view = cancel_job(job_id, ctx)
    assert view.status == "cancelled" and view.finished_at
    assert not is_open(ctx, job_id)
    run_job(ctx, job_id)  # its message arrives anyway
    assert calls == [] and job(ctx, job_id).status == "cancelled"


def test_a_queued_job_whose_cancel_was_asked_is_cancelled_when_it_would_start(ctx: Context, use_body: Any) -> None:
    """A cancel recorded on a queued job without ending it (a concept's collections cancelled by
    the concept's deletion) stops it before its body runs."""
    calls: list[int] = []
    use_body(lambda c, j: calls.append(1) or {})
    job_id = submit(ctx)
    ctx.jobs.update(job_id, cancel_requested=True)
    run_job(ctx, job_id)
    assert calls == [] and job(ctx, job_id).status == "cancelled" and not is_open(ctx, job_id)


def test_cancelling_a_running_job_stops_it_at_its_next_check(ctx: Context, use_body: Any) -> None:
    started, steps = threading.Event(), []

    def body(c: Context, j: dict[str, Any]) -> dict[str, Any]:
        progress = ProgressReporter(c, j.job_id, total=1000)
        started.set()
        for _ in range(1000):
            time.sleep(0.01)
            progress.advance()
            steps.append(1)
        return {}

    use_body(body)
    job_id = submit(ctx)
    runner = threading.Thread(target=run_job, args=(ctx, job_id))
    runner.start()
    assert started.wait(10)
    view = cancel_job(job_id, ctx)
    assert view.status == "running", "a running job ends when its body looks, not before"
    assert job(ctx, job_id).cancel_requested is True
    runner.join(10)
    assert not runner.is_alive()
    assert job(ctx, job_id).status == "cancelled" and len(steps) < 1000 and not is_open(ctx, job_id)


def test_a_cancel_landing_while_the_job_starts_keeps_it_cancelled_and_its_body_unrun(
    ctx: Context, use_body: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API's DELETE lands between the runner's read of the queued job and its write of
    ``running``: the job was answered (and called back) cancelled, its open marker dropped. Starting
    it anyway would run the work nobody wants, report it succeeded after all, and leave a running
    job no reconciler looks at (no open marker) if its worker died."""
    calls: list[int] = []
    use_body(lambda c, j: calls.append(1) or {})
    job_id = submit(ctx)
    update = ctx.jobs.update

    def racing_update(jid: str, **fields: Any) -> dict[str, Any]:
        if fields.get("status") == "running":
            cancel_job(jid, ctx)  # the DELETE, in the window
        return update(jid, **fields)

    monkeypatch.setattr(ctx.jobs, "update", racing_update)
    run_job(ctx, job_id)
    assert calls == [], "the body ran after its job was cancelled"
    assert job(ctx, job_id).status == "cancelled" and not is_open(ctx, job_id)


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "cancelled"])
def test_cancelling_a_finished_job_changes_nothing(ctx: Context, outcome: str) -> None:
    job_id = submit(ctx)
    ctx.jobs.update(job_id, status=outcome, finished_at="2026-01-01T00:00:00+00:00")
    before = job(ctx, job_id)
    view = cancel_job(job_id, ctx)
    assert view.status == outcome and job(ctx, job_id) == before
    assert before.cancel_requested is False


def test_a_body_stuck_past_its_cancel_grace_is_stopped_from_outside(
    context_with: Callable[..., Context], use_body: Any
) -> None:
    """A body that never checks (native code) and ignores its cancellation for ENGRAM_CANCEL_GRACE_S:
    the watchdog calls ``stuck_cancel`` (a Celery worker ends its pool process there)."""
    ctx = context_with(cancel_grace_s=0.5)
    release, stopped = threading.Event(), threading.Event()

    def body(c: Context, j: dict[str, Any]) -> dict[str, Any]:
        release.wait(20)  # no cancellation check in here
        return {}

    use_body(body)
    job_id = submit(ctx)
    runner = threading.Thread(target=run_job, args=(ctx, job_id), kwargs={"stuck_cancel": stopped.set})
    runner.start()
    time.sleep(1.2)
    assert not stopped.is_set(), "nobody asked it to stop"
    ctx.jobs.update(job_id, cancel_requested=True)
    asked = time.monotonic()
    assert stopped.wait(10)
    assert time.monotonic() - asked >= 0.5, "not before the grace"
    release.set()
    runner.join(10)


def test_a_running_job_sends_heartbeats_in_distributed_mode(redis_ctx: Context, use_body: Any) -> None:
    store = redis_ctx.jobs
    assert isinstance(store, RedisJobStore)
    alive_while_running: list[bool] = []

    def body(c: Context, j: dict[str, Any]) -> dict[str, Any]:
        time.sleep(2.5)  # past the heartbeat TTL (2 s): only a renewal keeps it alive
        alive_while_running.append(store.alive(j.job_id))
        return {}

    use_body(body)
    job_id = submit(redis_ctx)
    run_job(redis_ctx, job_id)
    assert alive_while_running == [True]
    assert job(redis_ctx, job_id).status == "succeeded"


def test_the_transient_errors_are_the_ones_a_retry_can_help() -> None:
    assert set(TRANSIENT_ERRORS) == {StorageUnavailable, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError}


# ---------------------------------------------------------------- a job run inline, a kind's helper


def test_a_body_runs_a_job_it_created_inline_through_the_context(ctx: Context, use_body: Any) -> None:
    """What a calibration does with its recommended variant: the runner hands every body itself as
    ``ctx.run_inline``, so the inner job goes through the same state machine, in this process."""
    inner_ids: list[str] = []

    def body(c: Context, j: Any) -> dict[str, Any]:
        if inner_ids:  # the inner job
            return {"inner": True}
        inner_ids.append(submit(c, model_id="inner"))
        assert c.run_inline is not None
        c.run_inline(c, inner_ids[0])
        return {"inner_status": job(c, inner_ids[0]).status}

    use_body(body)
    outer = submit(ctx, model_id="outer")
    run_job(ctx, outer)
    assert job(ctx, outer).result == {"inner_status": "succeeded", "worker": worker_name()}
    assert job(ctx, inner_ids[0]).result == {"inner": True, "worker": worker_name()}


@dataclass(frozen=True)
class StubHelper:
    """What the runner reads of a :class:`service.execution.kinds.Helper`: its body."""

    body: Callable[[Any, str, str], Any]


@pytest.mark.parametrize(
    ("raised", "level", "said"),
    [
        (RuntimeError("disk full"), "WARNING", "failed, the job takes over: disk full"),
        (JobCancelled(), "INFO", "stopped helping"),
    ],
)
def test_a_helper_that_fails_or_is_stopped_fails_nothing_and_says_why(
    ctx: Context, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raised: Exception, level: str, said: str
) -> None:
    def helper(c: Context, subject_id: str, job_id: str) -> None:
        raise raised

    monkeypatch.setitem(kinds.HELPERS, "universe", StubHelper(helper))
    job_id = submit(ctx, model_id="m")
    before = job(ctx, job_id)
    with caplog.at_level("INFO", logger="engram.runner"):
        run_helper(ctx, "universe", "u1", job_id)  # raises nothing
    assert job(ctx, job_id) == before, "a helper is not a job: its record is untouched"
    said_so = [record for record in caplog.records if said in record.getMessage()]
    assert [record.levelname for record in said_so] == [level]
    assert "universe u1" in said_so[0].getMessage() and job_id in said_so[0].getMessage()


def test_a_helper_runs_its_kinds_body_with_the_subject_and_the_job(ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    monkeypatch.setitem(kinds.HELPERS, "universe", StubHelper(lambda c, subject, job_id: calls.append((subject, job_id))))
    run_helper(ctx, "universe", "u1", "j" * 32)
    assert calls == [("u1", "j" * 32)]
