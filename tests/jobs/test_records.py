"""Job records as frozen models (``service.jobs.records``): every kind's record and payload survive
their stored form, a record written before ``format_version`` is read through the one migration,
and a stored record that cannot be read is refused naming the job, by each store and by the API.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from service.api.job_answers import unfinished_answer
from service.context import Context
from service.errors import ProblemDetails
from service.execution.embedded import SqliteJobStore, live_store_path
from service.execution.kinds import KINDS
from service.jobs.reconcile import reconcile_once
from service.jobs.records import (
    FORMAT_VERSION,
    PAYLOADS,
    JobRecord,
    MapPayload,
    UnreadableJobRecord,
    VariantPayload,
    read_job_record,
)
from service.jobs.store import OPEN_SET, JobKind, JobStore, RedisJobStore, new_job, utc_now
from service.storage.keys import OPEN_JOBS, job_key
from tests.helpers.app import in_process_server
from tests.helpers.jobs import SAMPLE_PAYLOADS, payload_for

KIND_NAMES: list[JobKind] = sorted(PAYLOADS)


def unversioned_record(kind: JobKind, payload: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A record exactly as ``new_job`` wrote it before records were versioned (commit d1c47c7 and
    earlier): these keys, in this order, ``callbacks`` a list, no ``format_version``."""
    return {
        "job_id": uuid.uuid4().hex,
        "kind": kind,
        "status": "queued",
        "progress": {"done": 0, "total": 0, "unit": "steps"},
        "error": None,
        "result": None,
        "created_at": "2026-11-20T10:00:00.000001+00:00",
        "started_at": None,
        "finished_at": None,
        "payload": payload,
        "cancel_requested": False,
        "callbacks": ["http://hook/"],
        "owner": "key#1",
        **fields,
    }


def test_the_kind_table_and_the_payload_table_name_the_same_kinds() -> None:
    assert set(KINDS) == set(PAYLOADS) == set(SAMPLE_PAYLOADS)
    assert all(PAYLOADS[kind].kind == kind for kind in PAYLOADS)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_every_kinds_record_and_payload_round_trip_through_their_stored_form(kind: JobKind) -> None:
    record = new_job(kind, payload_for(kind), unit="steps", callback_urls=["http://hook/"]).updated(
        status="succeeded",
        progress={"done": 3, "total": 3, "unit": "steps"},
        result={"answer": [1, 2.5, None], "nested": {"k": "v"}},
        started_at=utc_now(),
        finished_at=utc_now(),
        dispatch_epoch="e" * 32,
    )
    stored = json.loads(json.dumps(record.model_dump(mode="json")))  # what a store writes and reads back
    again = read_job_record(stored)
    assert again == record
    assert type(again.payload) is PAYLOADS[kind] and again.payload.model_dump(exclude_none=True) == SAMPLE_PAYLOADS[kind]
    assert stored["format_version"] == FORMAT_VERSION and stored["payload"] == record.payload.model_dump(mode="json")


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_record_written_before_format_version_is_read_as_version_1(kind: JobKind) -> None:
    old = unversioned_record(kind, SAMPLE_PAYLOADS[kind])
    record = read_job_record(json.loads(json.dumps(old)))
    assert record.format_version == 1
    # Every field it had keeps its value (callbacks become a tuple: records are frozen).
    assert {
        **record.model_dump(mode="json", exclude={"format_version", "dispatch_epoch"}),
        "callbacks": old["callbacks"],
    } == {
        **old,
        "payload": record.payload.model_dump(mode="json"),
    }
    assert record.payload.model_dump(exclude_none=True) == old["payload"]


def test_the_oldest_records_without_owner_callbacks_or_queue_are_read_with_their_defaults() -> None:
    old = unversioned_record("variant", {"variant_id": "v" * 32, "model_id": "m"})
    for key in ("owner", "callbacks"):
        del old[key]
    record = read_job_record(old)
    assert (record.owner, record.callbacks, record.payload_of(VariantPayload).queue) == (None, (), None)


def test_a_stored_error_is_a_problem_record_that_stores_and_answers_the_same_bytes() -> None:
    """A failed job's problem, with extension members before the RFC 9457 ones (a conflict's
    ``jobs``) and after them (a budget's figures), in the order it was written: read as a
    :class:`ProblemDetails` and written back byte for byte, and answered with the job's ID."""
    error = {
        "jobs": [{"concept": "c", "job_id": "j" * 32, "status": "running", "url": "/jobs/" + "j" * 32}],
        "type": "https://engram.dev/problems/universe-budget-exceeded",
        "title": "Universe storage budget exceeded",
        "status": 409,
        "detail": "no room",
        "projected_bytes": 10,
        "key": None,
    }
    old = unversioned_record("map", SAMPLE_PAYLOADS["map"], status="failed", error=error)
    record = read_job_record(json.loads(json.dumps(old)))
    assert isinstance(record.error, ProblemDetails) and record.error.status == 409 and record.error.detail == "no room"
    assert json.dumps(record.model_dump(mode="json")["error"]) == json.dumps(error)
    answer = unfinished_answer(record, "this map")
    assert answer.status_code == 409
    assert answer.body == json.dumps({**error, "job_id": record.job_id}, separators=(",", ":")).encode()


def test_an_unversioned_record_in_storage_is_served_and_rewritten_as_version_1_by_its_next_change(ctx: Context) -> None:
    old = unversioned_record("map", SAMPLE_PAYLOADS["map"], dispatch_epoch="x" * 32)
    ctx.storage.put_json(job_key(old["job_id"]), old)
    ctx.storage.put_bytes(OPEN_JOBS + old["job_id"], b"")
    record = ctx.jobs.get(old["job_id"])
    assert record is not None and record.payload_of(MapPayload).map_id == SAMPLE_PAYLOADS["map"]["map_id"]
    assert [j.job_id for j in ctx.jobs.active()] == [old["job_id"]]
    ctx.jobs.update(old["job_id"], status="cancelled", finished_at=utc_now())
    rewritten = ctx.storage.get_json(job_key(old["job_id"]))
    assert rewritten["format_version"] == 1 and rewritten["status"] == "cancelled"
    assert rewritten["dispatch_epoch"] == "x" * 32 and rewritten["owner"] == "key#1"


def _bad_records() -> dict[str, tuple[Any, str]]:
    """Stored records this version cannot read, and what the refusal says of each."""
    good = unversioned_record("map", SAMPLE_PAYLOADS["map"])
    return {
        "a newer format": ({**good, "format_version": 2}, "format_version 2; this version reads 1"),
        "a payload missing a field": ({**good, "payload": {"model_id": "m"}}, "payload.map_id: Field required"),
        "an unknown kind": ({**good, "kind": "teleport"}, "kind: Input should be"),
        "a payload of another kind": (
            {**good, "payload": SAMPLE_PAYLOADS["variant"]},
            "payload.map_id: Field required; payload.variant_id: Extra inputs are not permitted",
        ),
        "a field of the wrong type": (
            {**good, "progress": {"done": "many"}},
            "progress.done: Input should be a valid integer",
        ),
        "not an object": ([good], "a JSON list, not an object"),
    }


@pytest.mark.parametrize("case", sorted(_bad_records()))
def test_a_stored_record_that_cannot_be_read_is_refused_naming_the_job(case: str) -> None:
    stored, why = _bad_records()[case]
    job_id = stored["job_id"] if isinstance(stored, dict) else "f" * 32
    with pytest.raises(UnreadableJobRecord) as refused:
        read_job_record(stored, job_id)
    assert refused.value.detail.startswith(f"the stored record of job {job_id} cannot be read: ")
    assert why in refused.value.detail
    assert refused.value.to_problem().status == 503  # as every unreadable stored record


def test_each_store_refuses_an_unreadable_record_by_name_and_lists_the_others(
    tmp_path: Path, ctx: Context, redis_ctx: Context, client: redis.Redis
) -> None:
    bad = {**unversioned_record("map", SAMPLE_PAYLOADS["map"]), "format_version": 7}
    job_id = bad["job_id"]
    # Durable: object storage, read by every store.
    ctx.storage.put_json(job_key(job_id), bad)
    ctx.storage.put_bytes(OPEN_JOBS + job_id, b"")
    fine = ctx.jobs.create(new_job("map", payload_for("map"), unit="layers"))
    with pytest.raises(UnreadableJobRecord, match=f"job {job_id} cannot be read: format_version 7"):
        ctx.jobs.get(job_id)
    assert [j.job_id for j in JobStore(ctx.storage).active()] == [fine.job_id], "one bad record stops no listing"
    # Live in Redis.
    client.set(f"engram:job:{job_id}", json.dumps(bad))
    with pytest.raises(UnreadableJobRecord, match=f"job {job_id} cannot be read"):
        redis_ctx.jobs.get(job_id)
    # Live in embedded mode's SQLite file.
    sqlite = SqliteJobStore(ctx.storage, tmp_path / "live.sqlite")
    with sqlite3.connect(tmp_path / "live.sqlite") as connection:
        connection.execute(
            "INSERT INTO jobs (job_id, kind, status, finished_at, body) VALUES (?, 'map', 'queued', NULL, ?)",
            (job_id, json.dumps(bad)),
        )
    with pytest.raises(UnreadableJobRecord, match=f"job {job_id} cannot be read"):
        sqlite.get(job_id)


def test_the_api_answers_an_unreadable_job_with_a_problem_naming_it(tmp_path: Path) -> None:
    bad = {**unversioned_record("map", SAMPLE_PAYLOADS["map"]), "payload": {"model_id": "m"}}
    with in_process_server(tmp_path, tmp_path / "models") as server:
        (server.storage_dir / "jobs").mkdir(exist_ok=True)
        (server.storage_dir / "jobs" / f"{bad['job_id']}.json").write_text(json.dumps(bad))
        answer = server.client.get(f"/jobs/{bad['job_id']}")
        # A live row the status middleware cannot read: it leaves the answer to the route.
        live = {**unversioned_record("map", SAMPLE_PAYLOADS["map"]), "format_version": 3}
        with sqlite3.connect(live_store_path(server.settings)) as connection:
            connection.execute(
                "INSERT INTO jobs (job_id, kind, status, finished_at, body) VALUES (?, 'map', 'queued', NULL, ?)",
                (live["job_id"], json.dumps(live)),
            )
        live_answer = server.client.get(f"/jobs/{live['job_id']}")
    assert live_answer.status_code == 503 and live_answer.headers["content-type"].startswith("application/problem+json")
    assert live_answer.json()["detail"].startswith(
        f"the stored record of job {live['job_id']} cannot be read: format_version 3"
    )
    assert answer.status_code == 503 and answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["title"] == "Unreadable job record"
    assert (
        answer.json()["detail"] == f"the stored record of job {bad['job_id']} cannot be read: payload.map_id: Field required"
    )


def test_records_are_frozen_and_an_update_is_checked_as_a_stored_record_is() -> None:
    record = new_job("map", payload_for("map"), unit="layers")
    with pytest.raises(ValidationError, match="frozen"):
        record.status = "running"  # type: ignore[misc]
    with pytest.raises(TypeError, match="a job record has no field colour"):
        record.updated(colour="blue")
    with pytest.raises(ValidationError, match="status"):
        record.updated(status="exploded")
    with pytest.raises(ValidationError, match="a map job cannot carry a VariantPayload"):
        JobRecord.model_validate({**record.model_dump(), "payload": payload_for("variant")})
    with pytest.raises(TypeError, match=f"job {record.job_id} is a map job, not a variant job"):
        record.payload_of(VariantPayload)
    assert record.updated(status="running").status == "running" and record.status == "queued"


def test_passes_over_many_jobs_log_an_unreadable_record_by_name_and_go_on(
    tmp_path: Path, redis_ctx: Context, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The reconciler, admission's exact recount and embedded mode's listings each meet a record
    this version cannot read: each names it in the log and handles every other job as before."""
    store = redis_ctx.jobs
    assert isinstance(store, RedisJobStore)
    bad = {**unversioned_record("map", SAMPLE_PAYLOADS["map"], owner="key#1"), "format_version": 9}
    store.storage.put_json(job_key(bad["job_id"]), bad)
    store.storage.put_bytes(OPEN_JOBS + bad["job_id"], b"")
    client.sadd(OPEN_SET, bad["job_id"])
    client.sadd(OPEN_SET + ":key#1", bad["job_id"])
    lost = store.create(new_job("map", payload_for("map"), unit="layers"))
    client.delete(f"engram:job:{lost.job_id}")  # Redis lost this one: the reconciler dispatches it again
    dispatched: list[str] = []
    with caplog.at_level(logging.ERROR):
        assert reconcile_once(store, lambda job: dispatched.append(job.job_id)) == [lost.job_id] == dispatched
        assert store.open_counts("key#1", exact=True) == (1, 0), "nothing can run it: it is not counted open"
        sqlite = SqliteJobStore(store.storage, tmp_path / "live.sqlite")
        sqlite.create(new_job("map", payload_for("map"), unit="layers"))
        with sqlite3.connect(tmp_path / "live.sqlite") as connection:
            connection.execute(
                "INSERT INTO jobs (job_id, kind, status, finished_at, body) VALUES (?, 'map', 'queued', NULL, ?)",
                (bad["job_id"], json.dumps(bad)),
            )
        assert len(sqlite.active()) == 1 and sqlite.queued_by_queue()["gpu"] == 2, "the row is still counted queued"
    named = [r.getMessage() for r in caplog.records if bad["job_id"] in r.getMessage()]
    assert len(named) >= 3 and all("format_version 9" in message for message in named)
