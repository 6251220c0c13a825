"""A repeated request follows the job that exists (``service.jobs.submit.attach_callbacks``): its new
callback URLs join that job, an unfinished job keeps them durably for when it ends, and a finished
job calls them back at once, without calling the old ones again."""

from __future__ import annotations

from service.context import Context
from service.jobs.store import new_job
from service.jobs.submit import attach_callbacks
from service.storage.keys import PENDING_CALLBACKS
from tests.helpers.jobs import payload_for


def outbox(ctx: Context) -> list[str]:
    return sorted(ctx.storage.get_json(key)["url"] for key in ctx.storage.list(PENDING_CALLBACKS))


def test_new_urls_join_an_unfinished_job_and_are_called_when_it_ends(ctx: Context) -> None:
    job = ctx.jobs.create(new_job("collect", payload_for("collect"), unit="tokens", callback_urls=["http://a/"]))
    joined = attach_callbacks(ctx, job, ["http://a/", "http://b/"])
    assert joined.callbacks == ("http://a/", "http://b/")
    assert ctx.storage.get_json(f"jobs/{job.job_id}.json")["callbacks"] == ["http://a/", "http://b/"], "durable"
    assert outbox(ctx) == []
    ctx.jobs.update(job.job_id, status="succeeded")
    assert outbox(ctx) == ["http://a/", "http://b/"]


def test_a_finished_job_calls_only_the_new_urls_back_at_once(ctx: Context) -> None:
    woken: list[int] = []
    ctx.jobs.on_finished = lambda: woken.append(1)
    job = ctx.jobs.create(new_job("collect", payload_for("collect"), unit="tokens", callback_urls=["http://a/"]))
    ctx.jobs.update(job.job_id, status="succeeded")
    for key in ctx.storage.list(PENDING_CALLBACKS):  # a/ was delivered
        ctx.storage.delete(key)
    woken.clear()
    done = ctx.jobs.get(job.job_id)
    assert done is not None
    attach_callbacks(ctx, done, ["http://a/", "http://c/"])
    assert outbox(ctx) == ["http://c/"] and woken == [1]


def test_urls_the_job_has_already_change_nothing(ctx: Context) -> None:
    job = ctx.jobs.create(new_job("collect", payload_for("collect"), unit="tokens", callback_urls=["http://a/"]))
    assert attach_callbacks(ctx, job, ["http://a/"]) is job
    assert attach_callbacks(ctx, job, []) is job
