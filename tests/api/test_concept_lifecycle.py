"""Concept deletion, creation metadata on models and concepts, and the audit log's retention and log
lines, through the HTTP API (issue 39).

One keyed app (read, two write and an admin key, random per run; a receipt signing key) over its own
file store, called in this process (``tests.helpers.app``), with two tiny Llamas: ``lab/m`` registered
by the first write key with labels and a reason, ``lab/n`` by the admin key without. The store is
read from its folder: what a deletion removed is the difference of two listings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from engram_fixtures.demo import make_facts
from engram_fixtures.live import wait_concepts_ready, wait_for_job
from service.api.auth import key_identity
from service.observability import _json_formatter
from service.storage.keys import audit_key
from tests.helpers.api import assert_problem, jsonl, register_model
from tests.helpers.app import InProcessServer, another_client, in_process_server
from tests.helpers.job_process import own_job_process, paused

M, N = "lab/m", "lab/n"
READ_CACHE_S = 1.2  # views read documents as of at most a second ago (service.storage.read_cache)


class Lines(logging.Handler):
    """Every log record of the app (this process), formatted as a handler would write it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in self.records)


@dataclass
class World:
    server: InProcessServer
    clients: dict[str, httpx.Client]  # read, write, write2, admin
    keys: dict[str, str]  # the same names -> the key itself
    pem: str  # the receipt signing key
    lines: Lines

    def who(self, name: str) -> str:
        return key_identity(self.keys[name])

    def stored(self) -> set[str]:
        root = self.server.storage_dir
        found = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
        return {k for k in found if not k.startswith(("audit/", "."))}

    def post_concept(self, client: str, name: str, records: list[dict[str, Any]], models: list[str], **more: Any) -> None:
        posted = self.clients[client].post("/concepts", json={"name": name, "models": models, "records": records, **more})
        assert posted.status_code == 202, posted.text
        for job in posted.json()["jobs"]:
            assert wait_for_job(self.clients[client], job["job_id"], timeout=300)["status"] == "succeeded"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from engram_fixtures.models import make_tiny_llama

    root = tmp_path_factory.mktemp("lifecycle")
    m = make_tiny_llama(root / "models" / "m", hidden=32, layers=2, tie_word_embeddings=True)
    n = make_tiny_llama(root / "models" / "n", hidden=32, layers=2, tie_word_embeddings=False)
    keys = {name: secrets.token_urlsafe(24) for name in ("read", "write", "write2", "admin")}
    scopes = {"read": "read", "write": "write", "write2": "write", "admin": "admin"}
    pem = (
        Ed25519PrivateKey.generate()
        .private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        .decode()
    )
    lines, engram = Lines(), logging.getLogger("engram")
    engram.addHandler(lines)
    level, engram.level = engram.level, logging.DEBUG
    setting = ",".join(f"{key}:{scopes[name]}" for name, key in keys.items())
    try:
        with in_process_server(root, root / "models", ENGRAM_API_KEYS=setting, ENGRAM_RECEIPT_SIGNING_KEY=pem) as server:
            clients = {s: another_client(server, {"Authorization": f"Bearer {k}"}) for s, k in keys.items()}
            labels = {"labels": {"team": "alpha", "ticket": "T-1"}, "reason": "the forget set of T-1"}
            register_model(clients["write"], M, f"file://{m}", fields=labels)
            register_model(clients["admin"], N, f"file://{n}")
            yield World(server, clients, keys, pem, lines)
            for client in clients.values():
                client.close()
    finally:
        engram.removeHandler(lines)
        engram.setLevel(level)


def _names(answer: httpx.Response, field: str) -> list[str]:
    assert answer.status_code == 200, answer.text
    return sorted(item[field] for item in answer.json())


def test_models_show_who_registered_them_and_lists_filter_by_it(world: World) -> None:
    read = world.clients["read"]
    mine = read.get(f"/models/{M}").json()
    assert (mine["created_by"], mine["labels"], mine["reason"]) == (
        world.who("write"),
        {"team": "alpha", "ticket": "T-1"},
        "the forget set of T-1",
    )
    created = datetime.fromisoformat(mine["created_at"])
    assert abs(datetime.now(timezone.utc) - created) < timedelta(hours=1)
    theirs = read.get(f"/models/{N}").json()
    assert (theirs["created_by"], theirs["labels"], theirs["reason"]) == (world.who("admin"), {}, None)

    assert _names(read.get("/models", params={"label": "team:alpha"}), "model_id") == [M]
    assert _names(read.get("/models", params={"label": ["team:alpha", "ticket:T-2"]}), "model_id") == []
    assert _names(read.get("/models", params={"created_by": world.who("admin")}), "model_id") == [N]
    assert _names(read.get("/models", params={"created_after": mine["created_at"]}), "model_id") == sorted([M, N])
    assert _names(read.get("/models", params={"created_before": mine["created_at"]}), "model_id") == []
    assert _names(read.get("/models", params={"created_after": "2999-01-01T00:00:00Z"}), "model_id") == []
    paged = read.get("/models", params={"limit": 1, "created_after": "2000-01-01"})
    assert len(paged.json()) == 1 and "X-Next-Cursor" in paged.headers
    assert_problem(read.get("/models", params={"label": "team"}), 422, "label=key:value")
    assert_problem(read.get("/models", params={"created_after": "yesterday"}), 422, "created_after", "ISO 8601")


def test_bad_labels_and_reasons_are_refused_and_change_nothing(world: World) -> None:
    write = world.clients["write"]
    before = world.stored()
    too_many = {f"k{i}": "v" for i in range(33)}
    bodies = [
        {"model_id": "lab/x", "source": "file:///nowhere", "labels": too_many},
        {"model_id": "lab/x", "source": "file:///nowhere", "labels": {"bad key": "v"}},
        {"model_id": "lab/x", "source": "file:///nowhere", "labels": {"k": "v" * 257}},
        {"model_id": "lab/x", "source": "file:///nowhere", "reason": "r" * 2001},
        {"model_id": "lab/x", "source": "file:///nowhere", "reason": ""},
    ]
    for body in bodies:
        assert_problem(write.post("/models", json=body), 422)
    records = [{"text": "a"}]
    assert_problem(write.post("/concepts", json={"name": "x", "models": [M], "records": records, "labels": too_many}), 422)
    form = {"name": "x", "models": M, "labels": "team=alpha"}
    refused = write.post("/concepts", data=form, files={"dataset": ("d.jsonl", jsonl(records))})
    assert_problem(refused, 422, "labels", "JSON object")
    form["labels"] = json.dumps({"bad key": "v"})
    assert_problem(write.post("/concepts", data=form, files={"dataset": ("d.jsonl", jsonl(records))}), 422)
    assert world.stored() == before


def test_concepts_show_who_created_them_json_and_multipart(world: World) -> None:
    facts = [{"prompt": p, "completion": c} for p, c in make_facts(4, seed=11)]
    world.post_concept("write", "meta-json", facts, [M], labels={"source": "json"}, reason="ticket T-7")
    form = {"name": "meta-form", "models": M, "labels": json.dumps({"source": "form"}), "reason": "ticket T-8"}
    posted = world.clients["write2"].post("/concepts", data=form, files={"dataset": ("d.jsonl", jsonl(facts[:3]))})
    assert posted.status_code == 202, posted.text
    assert (posted.json()["concept"]["labels"], posted.json()["concept"]["reason"]) == ({"source": "form"}, "ticket T-8")
    wait_concepts_ready(world.clients["read"], ["meta-form"], M)

    read = world.clients["read"]
    shown = read.get("/concepts/meta-json").json()
    assert (shown["created_by"], shown["labels"], shown["reason"]) == (world.who("write"), {"source": "json"}, "ticket T-7")
    assert datetime.fromisoformat(shown["created_at"]) <= datetime.now(timezone.utc)
    assert read.get("/concepts/meta-form").json()["created_by"] == world.who("write2")
    assert _names(read.get("/concepts", params={"label": "source:form"}), "name") == ["meta-form"]
    assert _names(read.get("/concepts", params={"created_by": world.who("write")}), "name") == ["meta-json"]
    after = read.get("/concepts", params={"created_after": shown["created_at"], "label": "source:json"})
    assert _names(after, "name") == ["meta-json"]
    assert (
        _names(read.get("/concepts", params={"created_before": shown["created_at"], "label": "source:json"}), "name") == []
    )
    # Posted again (the same records) with other metadata: the first request's stays.
    again = world.clients["write"].post(
        "/concepts", json={"name": "meta-json", "models": [M], "records": facts, "labels": {"source": "other"}}
    )
    assert again.status_code == 202, again.text
    assert read.get("/concepts/meta-json").json()["labels"] == {"source": "json"}
    for name, client in (("meta-json", "write"), ("meta-form", "write2")):
        assert world.clients[client].delete(f"/concepts/{name}").status_code == 204


def test_records_stored_without_metadata_still_load(world: World) -> None:
    root = world.server.storage_dir
    facts = [{"text": t} for t in ("old one", "old two")]
    world.post_concept("admin", "modern", facts, [N])
    stored = json.loads((root / "concepts" / "modern.json").read_text())
    legacy = {k: v for k, v in stored.items() if k not in {"created_by", "labels", "reason"}}
    (root / "concepts" / "legacy.json").write_text(json.dumps({**legacy, "name": "legacy"}))
    registration = root / "registrations" / "lab%2Fn.json"
    kept = json.loads(registration.read_text())
    registration.write_text(json.dumps({k: kept[k] for k in ("model_id", "source", "job_id")}))
    time.sleep(READ_CACHE_S)

    read = world.clients["read"]
    concept = read.get("/concepts/legacy")
    assert concept.status_code == 200, concept.text
    assert (concept.json()["created_by"], concept.json()["labels"], concept.json()["reason"]) == (None, {}, None)
    assert concept.json()["created_at"] == stored["created_at"]
    assert "legacy" in _names(read.get("/concepts"), "name")
    assert "legacy" not in _names(read.get("/concepts", params={"created_by": world.who("admin")}), "name")
    model = read.get(f"/models/{N}").json()  # created_by from its register job, the time from its registration
    assert (model["created_by"], model["labels"], model["reason"]) == (world.who("admin"), {}, None)
    assert model["created_at"] is not None
    registration.unlink()
    time.sleep(READ_CACHE_S)
    bare = read.get(f"/models/{N}")
    assert bare.status_code == 200, bare.text
    assert (bare.json()["created_by"], bare.json()["labels"]) == (None, {})
    registration.write_text(json.dumps(kept))
    for name in ("legacy", "modern"):
        assert world.clients["admin"].delete(f"/concepts/{name}").status_code == 204


def _universe(world: World, concept: str) -> str:
    made = world.clients["write"].post(f"/models/{M}/universes", json={"concepts": [concept]})
    assert made.status_code in (200, 202), made.text
    if made.json().get("job"):
        assert wait_for_job(world.clients["write"], made.json()["job"]["job_id"], timeout=300)["status"] == "succeeded"
    return str(made.json()["universe"]["universe_id"])


def _variant(world: World, concept: str, universe: str) -> str:
    body = {"concepts": [concept], "alpha": 0.5, "universe": universe}
    made = world.clients["write"].post(f"/models/{M}/unlearn", json=body)
    assert made.status_code in (200, 202), made.text
    if made.json().get("job"):
        assert wait_for_job(world.clients["write"], made.json()["job"]["job_id"], timeout=300)["status"] == "succeeded"
    return str(made.json()["variant"]["variant_id"])


def _file_digests(client: httpx.Client, variant_id: str) -> dict[str, str]:
    variant = client.get(f"/variants/{variant_id}")
    assert variant.status_code == 200 and variant.json()["status"] == "ready", variant.text
    found = {}
    for entry in variant.json()["files"]:
        body = client.get(f"/variants/{variant_id}/files/{entry['path']}")
        assert body.status_code == 200, body.text
        found[entry["path"]] = hashlib.sha256(body.content).hexdigest()
    return found


def test_deleting_a_concept_removes_what_it_owns_and_nothing_else(world: World) -> None:
    """A variant of a universe that includes the concept is a 409 naming it; once it is deleted, the
    concept's record and statistics go, its dataset stays while a twin names the same records, and
    another concept and a variant of another universe stay intact and readable."""
    write, admin = world.clients["write"], world.clients["admin"]
    facts = [{"prompt": p, "completion": c} for p, c in make_facts(8, seed=12)]
    world.post_concept("write", "del-a", facts[:4], [M])
    world.post_concept("write", "del-b", facts[4:], [M])
    world.post_concept("admin", "del-twin", facts[:4], [N])  # the same records as del-a, on another model
    universe_a, universe_b = _universe(world, "del-a"), _universe(world, "del-b")
    variant_a, variant_b = _variant(world, "del-a", universe_a), _variant(world, "del-b", universe_b)
    files_b = _file_digests(world.clients["read"], variant_b)

    before = world.stored()
    refused = write.delete("/concepts/del-a")
    problem = assert_problem(refused, 409, variant_a, universe_a, "DELETE /variants/{id}")
    assert problem["dependents"] == {"variants": [variant_a], "universes": [universe_a]}
    assert_problem(write.delete("/concepts/del-a/statistics"), 409, variant_a)
    assert world.stored() == before  # nothing deleted
    assert write.delete(f"/variants/{variant_a}").status_code == 204
    assert_problem(world.clients["write2"].delete("/concepts/del-a"), 403, world.who("write"))
    assert_problem(world.clients["read"].delete("/concepts/del-a"), 403)

    concept_a = world.clients["read"].get("/concepts/del-a").json()
    before = world.stored()
    stats_a = {k for k in before if k.startswith(_stats_prefix(world, "del-a", before))}
    deleted = write.delete("/concepts/del-a")
    assert deleted.status_code == 204, deleted.text
    assert stats_a and any(k.endswith("manifest.json") for k in stats_a)
    assert before - world.stored() == {"concepts/del-a.json"} | stats_a
    assert world.stored() - before == set()
    assert f"datasets/{concept_a['dataset_digest']}.jsonl" in world.stored()  # del-twin names it
    assert_problem(write.delete("/concepts/del-a"), 404, "del-a")  # the second DELETE
    read = world.clients["read"]
    assert read.get("/concepts/del-b").json()["models"][M]["status"] == "ready"
    assert read.get(f"/universes/{universe_b}").status_code == 200
    assert _file_digests(read, variant_b) == files_b  # intact and readable, byte for byte

    before = world.stored()
    assert admin.delete("/concepts/del-twin").status_code == 204  # an admin deletes any concept
    gone = before - world.stored()
    assert f"datasets/{concept_a['dataset_digest']}.jsonl" in gone  # no concept names it now
    assert "concepts/del-twin.json" in gone
    assert write.delete(f"/variants/{variant_b}").status_code == 204
    assert write.delete("/concepts/del-b").status_code == 204


def _stats_prefix(world: World, name: str, keys: set[str]) -> str:
    """The statistics prefix a concept's record names on ``M`` (read from its stored record)."""
    record = json.loads((world.server.storage_dir / "concepts" / f"{name}.json").read_bytes())
    prefix = str(record["models"][M]["stats"])
    assert any(k.startswith(prefix) for k in keys), prefix
    return prefix


def test_deleting_only_statistics_keeps_the_concept_and_posting_again_collects_them(world: World) -> None:
    write = world.clients["write"]
    facts = [{"prompt": p, "completion": c} for p, c in make_facts(4, seed=13)]
    world.post_concept("write", "stats-only", facts, [M])
    prefix = _stats_prefix(world, "stats-only", world.stored())
    assert_problem(write.delete("/concepts/stats-only/statistics", params={"model_id": N}), 404, N)
    before = world.stored()
    deleted = write.delete("/concepts/stats-only/statistics", params={"model_id": M})
    assert deleted.status_code == 204, deleted.text
    assert before - world.stored() == {k for k in before if k.startswith(prefix)}
    time.sleep(READ_CACHE_S)
    shown = world.clients["read"].get("/concepts/stats-only").json()
    assert shown["models"] == {}
    assert shown["created_by"] == world.who("write")  # its metadata kept
    world.post_concept("write", "stats-only", facts, [M])  # collected anew
    assert any(k.startswith(prefix) for k in world.stored())
    assert write.delete("/concepts/stats-only").status_code == 204


def test_a_collection_in_progress_is_a_409_naming_its_job(world: World) -> None:
    write = world.clients["write"]
    facts = [{"prompt": p, "completion": c} for p, c in make_facts(4, seed=14)]
    with paused(own_job_process(world.server)):
        posted = write.post("/concepts", json={"name": "busy", "models": [M], "records": facts})
        assert posted.status_code == 202, posted.text
        job_id = posted.json()["jobs"][0]["job_id"]
        before = world.stored()
        problem = assert_problem(write.delete("/concepts/busy"), 409, job_id, "DELETE /jobs/{id}")
        assert problem["dependents"] == {"jobs": [job_id]}
        assert_problem(write.delete("/concepts/busy/statistics"), 409, job_id)
        assert world.stored() == before
    assert wait_for_job(write, job_id, timeout=300)["status"] == "succeeded"
    assert write.delete("/concepts/busy").status_code == 204


def test_every_audit_entry_is_one_log_line_and_no_secret_is_in_either(world: World) -> None:
    start = len(world.lines.records)
    write = world.clients["write"]
    world.post_concept("write", "audited", [{"text": "audited text"}], [M], reason="audit check")
    assert write.delete("/concepts/audited").status_code == 204
    wrong = another_client(world.server, {"Authorization": "Bearer " + "x" * 24})
    assert wrong.post("/concepts", json={}).status_code == 401
    wrong.close()

    logged = [json.loads(r.getMessage()) for r in world.lines.records[start:] if r.name == "engram.audit"]
    entries = world.clients["admin"].get("/audit", params={"limit": 500}).json()
    mine = [e for e in entries if e["request_id"] in {line["request_id"] for line in logged}]
    assert len(logged) == len(mine) >= 3  # each entry once in the log: the POST, the DELETE, the 401
    assert sorted(json.dumps(e, sort_keys=True) for e in mine) == sorted(json.dumps(e, sort_keys=True) for e in logged)
    formatter = _json_formatter()  # what ENGRAM_LOG_FORMAT=json writes: one JSON object per line
    for record in (r for r in world.lines.records[start:] if r.name == "engram.audit"):
        line = formatter.format(record)
        assert "\n" not in line
        assert json.loads(json.loads(line)["message"]) == json.loads(record.getMessage())
    deletion = next(e for e in logged if e["method"] == "DELETE")
    assert (deletion["key"], deletion["status"], deletion["route"]) == (world.who("write"), 204, "/concepts/{name}")

    secrets_ = [*world.keys.values(), _pem_body(world.pem)]
    stored = b"".join(p.read_bytes() for p in (world.server.storage_dir / "audit").rglob("*.json"))
    text = world.lines.text() + json.dumps(entries)
    for secret in secrets_:
        assert secret not in text
        assert secret.encode() not in stored


def _pem_body(pem: str) -> str:
    """The key material of a PEM (its base64 body, without the armour lines)."""
    return "".join(line for line in pem.splitlines() if not line.startswith("-----"))


def test_audit_retention_drops_entries_past_their_age(tmp_path: Path) -> None:
    """With ENGRAM_AUDIT_RETENTION_DAYS=5, the janitor's first pass (at start-up) deletes the entries
    older than 5 days and keeps the others; without it, the log is kept whole."""
    now = datetime.now(timezone.utc)
    store = tmp_path / "store"
    ages = {"old": timedelta(days=9), "edge": timedelta(days=5, hours=1), "young": timedelta(days=4, hours=23)}
    keys = {name: audit_key(now - age, f"seeded-{name}", "00000000") for name, age in ages.items()}
    for key in keys.values():
        (store / key).parent.mkdir(parents=True, exist_ok=True)
        (store / key).write_text("{}")
    (tmp_path / "models").mkdir()
    with in_process_server(tmp_path, tmp_path / "models", ENGRAM_AUDIT_RETENTION_DAYS="5") as server:
        deadline = time.monotonic() + 60
        while (store / keys["old"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the janitor's first pass runs in its thread at start-up
        server.client.post("/concepts", json={})  # one more entry: now's, kept
    assert not (store / keys["old"]).exists()
    assert not (store / keys["edge"]).exists()
    assert (store / keys["young"]).exists()
    assert len(list((store / "audit").rglob("*.json"))) == 2  # the young one and the request's
