"""Which job kinds exist, where each runs and which function does its work (``service.execution.kinds``),
and the sender that puts a job on its kind's queue (``service.execution.queues``): the one table, and the
Celery worker registered from it. The sender is tested against a private ``redis-server`` as
Celery's broker: the messages are read back from Redis' lists as a worker would take them.
"""

from __future__ import annotations

import base64
import inspect
import json
from pathlib import Path
from typing import Any, get_args

import pytest
import redis

from engram_fixtures.live import RedisServer
from service.config import Settings
from service.execution.kinds import HELPERS, KINDS
from service.execution.queues import QUEUES, CelerySender, make_celery
from service.jobs.store import JobKind, RedisJobStore, new_job
from service.storage.local import LocalStorage
from tests.helpers.jobs import payload_for


def test_every_kind_has_one_entry_with_its_own_task() -> None:
    assert set(KINDS) == set(get_args(JobKind))
    tasks = [kind.task for kind in KINDS.values()] + [helper.task for helper in HELPERS.values()]
    assert len(set(tasks)) == len(tasks), "a task name per kind"
    assert {kind.queue for kind in KINDS.values()} == set(QUEUES) == {"gpu", "cpu"}
    assert set(HELPERS) == {"universe"}, "a universe build's helpers are the kind table's"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_body_is_a_function_of_a_context_and_a_job(kind: str) -> None:
    body = KINDS[kind].body  # type: ignore[index]
    assert callable(body)
    assert len(inspect.signature(body).parameters) == 2, KINDS[kind].body_path  # type: ignore[index]


def test_the_worker_registers_a_task_per_kind_on_the_kinds_queue() -> None:
    from workers.celery_app import app

    for kind in KINDS.values():
        assert kind.task in app.tasks, kind
        assert app.tasks[kind.task].queue == kind.queue, kind
    for name, helper in HELPERS.items():  # helpers run where their kind's job runs
        assert app.tasks[helper.task].queue == KINDS[name].queue, helper


def queued_messages(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """Celery messages waiting in ``queue`` (kombu's Redis transport: one list per queue)."""
    found = []
    for raw in client.lrange(queue, 0, -1):
        message = json.loads(raw)
        _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        found.append({"task": message["headers"]["task"], "kwargs": kwargs})
    return found


@pytest.fixture
def sender(redis_server: RedisServer, client: redis.Redis, tmp_path: Path) -> CelerySender:
    settings = Settings(storage_url=f"file://{tmp_path}", cache_dir=tmp_path / "cache", broker_url=redis_server.url)
    jobs = RedisJobStore(LocalStorage(tmp_path), client, heartbeat_ttl_s=30)
    return CelerySender(make_celery(settings), jobs)


def test_a_job_is_sent_to_its_kinds_queue_stamped_with_the_epoch(sender: CelerySender, client: redis.Redis) -> None:
    collect = sender.jobs.create(new_job("collect", payload_for("collect"), unit="tokens"))
    variant = sender.jobs.create(new_job("variant", payload_for("variant"), unit="layers"))
    sender.dispatch(collect)
    sender.dispatch(variant)
    assert queued_messages(client, "gpu") == [{"task": "engram.collect", "kwargs": {"job_id": collect.job_id}}]
    assert queued_messages(client, "cpu") == [{"task": "engram.build_variant", "kwargs": {"job_id": variant.job_id}}]
    assert sender.jobs.get(collect.job_id).dispatch_epoch == sender.jobs.epoch()  # type: ignore[union-attr]


def test_a_payload_may_send_its_job_to_another_queue(sender: CelerySender, client: redis.Redis) -> None:
    """A variant that must build its universe first goes where universes are built."""
    variant = sender.jobs.create(new_job("variant", payload_for("variant", queue="gpu"), unit="layers"))
    sender.dispatch(variant)
    assert [m["task"] for m in queued_messages(client, "gpu")] == ["engram.build_variant"]
    assert queued_messages(client, "cpu") == []


def test_universe_helpers_are_messages_not_jobs(sender: CelerySender, client: redis.Redis) -> None:
    sender.helpers("universe", "u1", "j" * 32, 3)
    helpers = queued_messages(client, "gpu")
    assert helpers == [{"task": "engram.help_universe", "kwargs": {"universe_id": "u1", "job_id": "j" * 32}}] * 3
    assert sender.jobs.active() == []


@pytest.mark.parametrize("kind", sorted(HELPERS))
def test_each_helper_is_a_function_of_a_context_a_subject_and_a_job(kind: str) -> None:
    helper = HELPERS[kind]  # type: ignore[index]
    assert callable(helper.body)
    assert list(inspect.signature(helper.body).parameters)[1:] == [helper.subject, "job_id"], helper.body_path
