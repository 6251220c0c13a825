"""The audit log, the job history and model/calibration deletion, through the HTTP API (issue 39).

One keyed app (a read, a write and an admin key, random per run) over its own file store, called in
this process (``tests.helpers.app``) with two tiny Llamas: ``acme/mine`` registered by the write key,
``acme/theirs`` by the admin key. The stored audit objects are read from the store's folder, and the
keys are searched for in their bytes: a key found there was really written.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import wait_for_job
from service.api.auth import key_identity
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer, another_client, in_process_server

MINE, THEIRS = "acme/mine", "acme/theirs"


@dataclass
class World:
    server: InProcessServer
    read: httpx.Client
    write: httpx.Client
    admin: httpx.Client
    keys: dict[str, str]  # scope -> the key itself

    def stored(self, without: str = "audit/") -> set[str]:
        """Every object in the store, as keys (``without``: a prefix left out)."""
        root = self.server.storage_dir
        found = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
        return {k for k in found if not k.startswith(without) and not k.startswith(".")}

    def audit_objects(self) -> list[bytes]:
        return [p.read_bytes() for p in sorted((self.server.storage_dir / "audit").rglob("*.json"))]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from engram_fixtures.models import make_tiny_llama

    root = tmp_path_factory.mktemp("audit")
    mine = make_tiny_llama(root / "models" / "mine", hidden=32, layers=2, tie_word_embeddings=True)
    theirs = make_tiny_llama(root / "models" / "theirs", hidden=32, layers=2, tie_word_embeddings=False)
    keys = {scope: secrets.token_urlsafe(24) for scope in ("read", "write", "admin")}
    setting = ",".join(f"{key}:{scope}" for scope, key in keys.items())
    with in_process_server(root, root / "models", ENGRAM_API_KEYS=setting) as server:
        clients = {s: another_client(server, {"Authorization": f"Bearer {k}"}) for s, k in keys.items()}
        register_model(clients["write"], MINE, f"file://{mine}")
        register_model(clients["admin"], THEIRS, f"file://{theirs}")
        yield World(server, clients["read"], clients["write"], clients["admin"], keys)
        for client in clients.values():
            client.close()


def _audit(world: World, **filters: Any) -> list[dict[str, Any]]:
    response = world.admin.get("/audit", params={"limit": 500, **filters})
    assert response.status_code == 200, response.text
    return response.json()


def test_get_jobs_browses_finished_jobs_and_keeps_its_default(world: World) -> None:
    succeeded = world.read.get("/jobs", params={"status": "succeeded", "kind": "register"})
    assert succeeded.status_code == 200, succeeded.text
    models = sorted(job["model_id"] for job in succeeded.json())
    assert models == [MINE, THEIRS]  # both register jobs, finished
    assert all(job["status"] == "succeeded" for job in succeeded.json())
    # The default answer is what it always was: only what is not finished (nothing runs now).
    assert world.read.get("/jobs").json() == []
    # A time range after both registrations lists none of them; one before them, both.
    latest = max(job["created_at"] for job in succeeded.json())
    after = world.read.get("/jobs", params={"status": "succeeded", "created_after": latest})
    assert [job["created_at"] for job in after.json()] == [latest]
    before = world.read.get("/jobs", params={"status": "succeeded", "created_before": "2000-01-01T00:00:00Z"})
    assert before.json() == []
    # Paged like every list: one job per page, the second reached through the cursor.
    first = world.read.get("/jobs", params={"status": "succeeded", "kind": "register", "limit": 1})
    second = world.read.get(
        "/jobs", params={"status": "succeeded", "kind": "register", "limit": 1, "cursor": first.headers["X-Next-Cursor"]}
    )
    assert sorted(j["model_id"] for j in first.json() + second.json()) == [MINE, THEIRS]
    assert "X-Next-Cursor" not in second.headers
    unknown = world.read.get("/jobs", params={"status": "done"})
    assert unknown.status_code == 422, unknown.text
    epoch = world.read.get("/jobs", params={"status": "succeeded", "created_before": "0.5"})  # not a Unix time
    assert epoch.status_code == 422, epoch.text
    assert "ISO 8601" in epoch.text


def test_deleting_a_model_removes_what_it_owned_and_is_audited(world: World) -> None:
    assert world.read.delete(f"/models/{MINE}").status_code == 403  # a read key never deletes
    not_theirs = world.write.delete(f"/models/{THEIRS}")  # a write key deletes only what it registered
    assert not_theirs.status_code == 403, not_theirs.text
    calibration = "0" * 32
    assert world.write.delete(f"/calibrations/{calibration}").status_code == 403  # calibrations: admin
    assert world.admin.delete(f"/calibrations/{calibration}").status_code == 404
    bad = world.write.post("/models", json={"model_id": "x", "sorce": "file:///nowhere"})
    assert bad.status_code == 422, bad.text

    before = world.stored()
    deleted = world.write.delete(f"/models/{MINE}")
    assert deleted.status_code == 204, deleted.text
    gone = before - world.stored()
    assert gone == {"models/acme%2Fmine.json", "registrations/acme%2Fmine.json"}
    assert world.stored() - before == set()  # nothing written but the audit entry
    assert world.read.get(f"/models/{MINE}").status_code == 404
    theirs = world.read.get(f"/models/{THEIRS}")
    assert theirs.status_code == 200, theirs.text
    assert theirs.json()["model_id"] == THEIRS
    assert world.write.delete(f"/models/{MINE}").status_code == 404  # idempotent: gone either way

    writer, reader = key_identity(world.keys["write"]), key_identity(world.keys["read"])
    entries = _audit(world, path_prefix=f"/models/{MINE}")
    steps = [(e["method"], e["status"], e["key"]) for e in entries]
    assert steps == [("DELETE", 403, reader), ("DELETE", 204, writer), ("DELETE", 404, writer)], steps
    done = entries[1]
    assert done["route"] == "/models/{model_id:path}"
    assert done["path_params"] == {"model_id": MINE}
    assert done["scope"] == "write"
    assert done["request_id"] == deleted.headers["x-request-id"]
    refused = _audit(world, method="POST", status=422)
    assert [(e["path"], e["key"], e["problem"]) for e in refused] == [("/models", writer, refused[0]["problem"])]
    registered = _audit(world, method="POST", path_prefix="/models")
    assert {e["resources"].get("model_id") for e in registered if e["status"] < 300} >= {MINE, THEIRS}
    admin_calibration = _audit(world, key=key_identity(world.keys["admin"]), path_prefix="/calibrations/")
    assert [(e["status"], e["path_params"]) for e in admin_calibration] == [(404, {"calibration_id": calibration})]


def test_the_audit_log_holds_no_secret_and_only_admins_read_it(world: World) -> None:
    world.write.post("/models?token=s3cr3t-query-value", json={"model_id": "y", "source": "file:///nowhere"})
    wrong = {"Authorization": "Bearer not-a-key-at-all"}
    stranger = world.server.client.post("/concepts", json={"name": "x"}, headers=wrong)
    assert stranger.status_code == 401
    [unknown] = _audit(world, status=401)
    assert (unknown["key"], unknown["path"], unknown["route"]) == (None, "/concepts", None)  # refused before routing
    stored = world.audit_objects()
    assert len(stored) >= 4  # the two registrations and this test's two requests, at least
    for raw in stored:
        for key in world.keys.values():
            assert key.encode() not in raw
        assert b"Bearer" not in raw
        assert b"not-a-key-at-all" not in raw
        assert b"s3cr3t-query-value" not in raw
        entry = json.loads(raw)
        assert entry["key"] is None or entry["key"].startswith("key-")
    last = _audit(world, path_prefix="/models", method="POST")[-1]
    assert last["query"] == ["token"]  # the parameter's name, never its value
    for client in (world.read, world.write):
        refused = client.get("/audit")
        assert refused.status_code == 403, refused.text
    paged = world.admin.get("/audit", params={"limit": 1})
    assert len(paged.json()) == 1
    assert "X-Next-Cursor" in paged.headers
    bounded = _audit(world, since="2000-01-01T00:00:00Z", until="2000-01-02T00:00:00Z")
    assert bounded == []


def test_audit_keys_sort_by_time_and_survive_odd_request_ids() -> None:
    from service.api.audit import key_safe
    from service.storage.keys import audit_key

    moments = [
        datetime(2026, 11, 29, 9, 59, 59, 999999, tzinfo=timezone.utc),
        datetime(2026, 11, 29, 10, tzinfo=timezone.utc),
    ]
    keys = [audit_key(moment, key_safe("a"), "0") for moment in moments]
    assert keys == sorted(keys)  # a whole second (no microseconds) sorts after the microsecond before it
    assert keys[1] == "audit/2026-11-29/100000.000000Z-a-0.json"
    assert "/" not in key_safe("../../etc/passwd") and key_safe("../../etc/passwd") != key_safe("..")


def test_a_request_that_crashes_is_audited_as_500_in_the_store_and_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The middleware around an app that raises (a route with a bug): the server answers 500, and the
    entry says 500. A bare Starlette app stands in for the service: no route of it crashes on purpose."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from service.api.audit import AuditLog
    from service.observability import RequestContext
    from service.storage.local import LocalStorage

    async def broken(_: Any) -> Any:
        raise RuntimeError("a bug")

    app = Starlette(routes=[Route("/things/{thing_id}", broken, methods=["POST"])])
    app.add_middleware(AuditLog, storage=LocalStorage(tmp_path), auth_on=False)
    app.add_middleware(RequestContext)
    with caplog.at_level("INFO", logger="engram.audit"), TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/things/t1", json={"secret": "record body"}, headers={"X-Request-ID": "../odd id"})
    assert answer.status_code == 500
    [stored] = sorted(tmp_path.rglob("*.json"))
    entry = json.loads(stored.read_bytes())
    assert (entry["status"], entry["path_params"], entry["key"], entry["request_id"]) == (
        500,
        {"thing_id": "t1"},
        "anonymous",
        "../odd id",
    )
    assert stored.parent.parent == tmp_path / "audit"  # the odd request ID did not leave the audit folder
    assert b"record body" not in stored.read_bytes()
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "engram.audit"]
    assert logged == [entry]  # the same line for a SIEM


def test_deleting_a_calibration_removes_its_records_only(world: World) -> None:
    """A 409 while its job waits (the job process paused), then its records gone and nothing else; the
    recommended variant it built stays, a variant in its own right."""
    from tests.helpers.job_process import own_job_process, paused

    facts = [{"prompt": p, "completion": c} for p, c in make_facts(12, seed=5)]
    posted = world.admin.post("/concepts", json={"name": "cal-facts", "models": [THEIRS], "records": facts[:6]})
    assert posted.status_code == 202, posted.text
    for job in posted.json()["jobs"]:
        assert wait_for_job(world.admin, job["job_id"], timeout=300)["status"] == "succeeded"
    body = {
        "concepts": ["cal-facts"],
        "forget": facts[:4],
        "retain": facts[6:],
        "max_retain_nll_ratio": 50.0,
        "module_sets": ["all"],
        "budget": 2,
    }
    with paused(own_job_process(world.server)):
        submitted = world.admin.post(f"/models/{THEIRS}/calibrate", json=body)
        assert submitted.status_code == 202, submitted.text
        calibration_id, job_id = submitted.json()["calibration_id"], submitted.json()["job"]["job_id"]
        before = world.stored()
        busy = world.admin.delete(f"/calibrations/{calibration_id}")
        assert busy.status_code == 409, busy.text
        assert job_id in busy.json()["detail"]
        assert world.stored() == before
    assert wait_for_job(world.admin, job_id, timeout=600)["status"] == "succeeded"
    assert world.write.delete(f"/calibrations/{calibration_id}").status_code == 403  # admin only

    before = world.stored()
    deleted = world.admin.delete(f"/calibrations/{calibration_id}")
    assert deleted.status_code == 204, deleted.text
    gone = before - world.stored()
    assert gone == {k for k in before if k.startswith(f"calibrations/{calibration_id}/")}
    assert f"calibrations/{calibration_id}/result.json" in gone
    assert world.stored() - before == set()
    assert world.read.get(f"/calibrations/{calibration_id}").status_code == 404
    assert world.admin.delete(f"/calibrations/{calibration_id}").status_code == 404
    # What it built and left: its recommended variant and the concept, deleted so the next test starts clean.
    for variant in world.read.get(f"/models/{THEIRS}/variants").json():
        assert world.admin.delete(f"/variants/{variant['variant_id']}").status_code == 204
    assert world.admin.delete("/concepts/cal-facts").status_code in (200, 204)


def test_a_model_still_needed_is_a_409_naming_it_and_cascade_deletes_what_it_owns(world: World) -> None:
    """A variant of the model and a concept collected on it refuse its deletion, and so does a universe
    unless cascade=true."""
    records = [{"prompt": p, "completion": c} for p, c in make_facts(4, seed=3)]
    posted = world.admin.post("/concepts", json={"name": "facts-theirs", "models": [THEIRS], "records": records})
    assert posted.status_code == 202, posted.text
    for job in posted.json()["jobs"]:
        assert wait_for_job(world.admin, job["job_id"], timeout=300)["status"] == "succeeded"
    universe = world.admin.post(f"/models/{THEIRS}/universes", json={"concepts": ["facts-theirs"]})
    assert universe.status_code in (200, 202), universe.text
    job = universe.json().get("job")
    if job:
        assert wait_for_job(world.admin, job["job_id"], timeout=300)["status"] == "succeeded"
    universe_id = universe.json()["universe"]["universe_id"]
    variant = world.admin.post(f"/models/{THEIRS}/unlearn", json={"concepts": ["facts-theirs"], "alpha": 0.5})
    assert variant.status_code in (200, 202), variant.text
    if variant.json().get("job"):
        assert wait_for_job(world.admin, variant.json()["job"]["job_id"], timeout=300)["status"] == "succeeded"
    variant_id = variant.json()["variant"]["variant_id"]

    before = world.stored()
    refused = world.admin.delete(f"/models/{THEIRS}")
    assert refused.status_code == 409, refused.text
    dependents = refused.json()["dependents"]
    assert dependents.keys() == {"variants", "concepts", "universes"}, dependents
    assert (dependents["variants"], dependents["concepts"]) == ([variant_id], ["facts-theirs"])
    universes = dependents["universes"]  # this test's, and another test's calibration's when it ran first
    assert universe_id in universes
    assert "DELETE /concepts/{name}" in refused.json()["detail"]
    assert "DELETE /variants/{id}" in refused.json()["detail"]
    assert world.stored() == before  # nothing deleted
    assert world.admin.delete(f"/variants/{variant_id}").status_code == 204
    dropped = world.admin.delete("/concepts/facts-theirs")
    assert dropped.status_code in (200, 204), dropped.text
    no_cascade = world.admin.delete(f"/models/{THEIRS}")
    assert no_cascade.status_code == 409, no_cascade.text
    assert no_cascade.json()["dependents"] == {"universes": universes}
    assert "cascade=true" in no_cascade.json()["detail"]

    before = world.stored()
    prefixes = (*(f"universes/{u}/" for u in universes), "model-universes/acme%2Ftheirs/")
    owned = {k for k in before if k.startswith(prefixes)}
    owned |= {"models/acme%2Ftheirs.json", "registrations/acme%2Ftheirs.json"}
    deleted = world.admin.delete(f"/models/{THEIRS}", params={"cascade": "true"})
    assert deleted.status_code == 204, deleted.text
    assert before - world.stored() == owned
    assert world.stored() - before == set()
    assert world.read.get(f"/models/{THEIRS}").status_code == 404
    assert world.read.get(f"/universes/{universe_id}").status_code == 404


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_the_audit_log_appends_and_reads_back_in_order_on_file_and_s3(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Ten requests through the middleware over a real store (a folder, or SeaweedFS with S3 pages of 7
    keys): ten objects, read back oldest first, each naming its own request; one day's listing the same."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from service.api.audit import AuditLog, audit_keys, read_entry
    from service.observability import RequestContext
    from service.storage.base import Storage
    from service.storage.local import LocalStorage

    storage: Storage
    if backend == "s3":
        from tests.helpers.s3 import s3_storage

        storage = s3_storage(request.getfixturevalue("seaweed"), request.getfixturevalue("s3_bucket"))
    else:
        storage = LocalStorage(tmp_path)

    async def made(req: Any) -> JSONResponse:
        return JSONResponse({"thing_id": req.path_params["thing_id"]}, status_code=201)

    app = Starlette(routes=[Route("/things/{thing_id}", made, methods=["POST"])])
    app.add_middleware(AuditLog, storage=storage, auth_on=False)
    app.add_middleware(RequestContext)
    with TestClient(app) as client:
        ids = [client.post(f"/things/t{i}").headers["x-request-id"] for i in range(10)]
    entries = [read_entry(storage, key) for key in audit_keys(storage, None, None)]
    assert [(e.request_id, e.resources, e.status) for e in entries if e] == [
        (rid, {"thing_id": f"t{i}"}, 201) for i, rid in enumerate(ids)
    ]
    first, last = entries[0], entries[-1]
    assert first is not None and last is not None
    assert list(audit_keys(storage, first.at, last.at)) == list(audit_keys(storage, None, None))  # by day prefixes


def test_a_stalled_store_does_not_hold_the_answer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store whose put takes 6 s (S3 retrying): the answer comes after the 2 s the entry is waited
    for, with an error naming the request; the put finishes in the background and the entry lands."""
    import time

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from service.api.audit import AuditLog
    from service.observability import RequestContext
    from service.storage.local import LocalStorage

    class Stalled(LocalStorage):
        def put_bytes(self, key: str, data: bytes) -> None:
            time.sleep(6)
            super().put_bytes(key, data)

    async def made(_: Any) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/things", made, methods=["POST"])])
    app.add_middleware(AuditLog, storage=Stalled(tmp_path), auth_on=False)
    app.add_middleware(RequestContext)
    with caplog.at_level("INFO", logger="engram.audit"), TestClient(app) as client:
        started = time.monotonic()
        answer = client.post("/things")
        waited = time.monotonic() - started
        assert answer.status_code == 201
        assert 2.0 <= waited < 5.0, waited
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and answer.headers["x-request-id"] in errors[0], errors
        deadline = time.monotonic() + 30
        while not list(tmp_path.rglob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert len(list((tmp_path / "audit").rglob("*.json"))) == 1
