"""Issue 39, the evaluation slice, through the HTTP API of a keyed server: a stored evaluation records
when it was asked for, the asking key's fingerprint, the request's labels and reason, and each probe
set's sha256 (of the probes as canonical JSON) and size; the receipt and the model card show them.
None of it is the evaluation's identity: the same probes from another key with other labels are the
same evaluation, answered with the first request's metadata. An evaluation stored before the fields
existed still loads, and a server without keys records ``anonymous``.

The variant is built beforehand in the same store by the real job bodies (tests.helpers.store_world);
the evaluations run in the server's in-process worker (real job bodies, real file storage).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_schemas.evaluation import EvaluationResult
from engram_fixtures.demo import make_facts
from service.api.auth import key_identity
from service.evaluation.run import evaluation_json
from service.variants.service import submit_variant
from tests.helpers.app import InProcessServer, another_client, in_process_server
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "meta/llama"
FACTS = make_facts(8, seed=23)
FORGET = [{"prompt": p, "completion": c} for p, c in FACTS[:3]]
RETAIN = [{"prompt": p, "completion": c} for p, c in FACTS[3:5]]
OTHER_RETAIN = [{"prompt": p, "completion": c} for p, c in FACTS[5:8]]
LABELS = {"ticket": "T-7", "suite": "nightly"}
REASON = "check erasure request 7"


@dataclass
class World:
    server: InProcessServer
    write: httpx.Client
    other_write: httpx.Client
    read: httpx.Client
    write_key: str
    other_key: str
    variant_id: str


def make_variant(root: Path) -> str:
    """A tiny Llama with two concepts and a ready delta variant unlearning one, in ``root/store``."""
    world = StoreWorld(root)
    world.tiny_llama(MODEL, {"a": text_records(0, 20, 11), "b": text_records(20, 40, 11)})
    view, _ = submit_variant(world.ctx, MODEL, {"a": -1.0}, 1.0, {"scaling": "uniform", "format": "delta"})
    for job in world.run_pending():
        assert job.status == "succeeded", job
    return str(view.variant_id)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("evaluation-metadata")
    variant_id = make_variant(root)
    read, write, other = (secrets.token_urlsafe(24) for _ in range(3))
    keys = f"{read}:read,{write}:write,{other}:write"
    with in_process_server(root, root / "models", ENGRAM_API_KEYS=keys) as server:
        clients = [another_client(server, {"Authorization": f"Bearer {k}"}) for k in (write, other, read)]
        yield World(server, clients[0], clients[1], clients[2], write, other, variant_id)


def sha256_of(probes: list[dict[str, Any]]) -> str:
    """The reference digest, computed here: sha256 of the probes as canonical JSON."""
    return hashlib.sha256(json.dumps(probes, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def evaluate(client: httpx.Client, variant_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(f"/variants/{variant_id}/evaluate", params={"wait": 60}, json=body)
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "succeeded", job
    return dict(job)


def stored_evaluations(world: World) -> dict[str, dict[str, Any]]:
    """The receipt's evaluations by ID."""
    response = world.read.get(f"/variants/{world.variant_id}/receipt")
    assert response.status_code == 200, response.text
    return {e["evaluation_id"]: e for e in response.json()["receipt"]["evaluations"]}


def test_an_evaluation_records_who_when_why_and_its_probes(world: World) -> None:
    before = datetime.now(timezone.utc)
    job = evaluate(world.write, world.variant_id, {"forget": FORGET, "retain": RETAIN, "labels": LABELS, "reason": REASON})
    after = datetime.now(timezone.utc)
    result = job["result"]
    assert result["created_by"] == key_identity(world.write_key) and result["created_by"].startswith("key-")
    assert before <= datetime.fromisoformat(result["created_at"]) <= after
    assert result["labels"] == LABELS and result["reason"] == REASON
    assert result["probe_sets"] == {
        "forget": {"sha256": sha256_of(FORGET), "n": 3},
        "retain": {"sha256": sha256_of(RETAIN), "n": 2},
    }
    assert world.write_key not in json.dumps(result)

    (stored,) = stored_evaluations(world).values()
    for field in ("created_at", "created_by", "labels", "reason", "probe_sets"):
        assert stored[field] == result[field], field
    card = world.read.get(f"/variants/{world.variant_id}/model-card")
    assert card.status_code == 200, card.text
    assert REASON in card.text and key_identity(world.write_key) in card.text
    assert f"forget `{sha256_of(FORGET)[:12]}` (3)" in card.text and "`ticket:T-7`" in card.text


def test_metadata_is_not_the_evaluations_identity(world: World) -> None:
    """The same probes from another key with other labels: the same evaluation, the first request's metadata."""
    first = evaluate(world.write, world.variant_id, {"forget": FORGET, "retain": RETAIN, "labels": LABELS, "reason": REASON})
    again = evaluate(world.other_write, world.variant_id, {"forget": FORGET, "retain": RETAIN, "labels": {"ticket": "T-8"}})
    assert again["job_id"] == first["job_id"]  # followed the job that stored the result
    assert again["result"]["labels"] == LABELS and again["result"]["created_by"] == key_identity(world.write_key)

    # Other retain probes: another evaluation, by the other key, whose forget set has the same digest.
    other = evaluate(world.other_write, world.variant_id, {"forget": FORGET, "retain": OTHER_RETAIN})
    assert other["job_id"] != first["job_id"]
    result = other["result"]
    assert result["created_by"] == key_identity(world.other_key) and result["labels"] == {} and "reason" not in result
    assert result["probe_sets"]["forget"] == first["result"]["probe_sets"]["forget"]
    assert result["probe_sets"]["retain"] == {"sha256": sha256_of(OTHER_RETAIN), "n": 3}
    assert len(stored_evaluations(world)) == 2


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"labels": {"bad key!": "x"}}, "label keys must match"),
        ({"labels": {"ticket": "a\nb"}}, "labels"),
        ({"reason": ""}, "reason"),
        ({"reason": "x" * 2001}, "reason"),
    ],
)
def test_bad_metadata_is_refused_and_changes_nothing(world: World, extra: dict[str, Any], named: str) -> None:
    def written() -> list[str]:  # what an evaluation writes: its probes, its job, its result
        store = world.server.storage_dir
        found = (p for d in ("probes", "jobs", "evaluations") for p in (store / d).rglob("*"))
        return sorted(p.relative_to(store).as_posix() for p in found)

    before = written()
    body = {"forget": FORGET, "retain": OTHER_RETAIN[:1], **extra}
    response = world.write.post(f"/variants/{world.variant_id}/evaluate", json=body)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert named in response.json()["detail"]
    assert written() == before and before


def test_an_evaluation_stored_before_the_metadata_still_loads(world: World) -> None:
    """A stored evaluation without the fields (as older versions wrote it) is served, shown and parsed."""
    job = evaluate(world.write, world.variant_id, {"forget": FORGET[:1]})
    evaluation_id = next(i for i, e in stored_evaluations(world).items() if e["probe_sets"]["forget"]["n"] == 1)
    path = world.server.storage_dir / "evaluations" / f"{evaluation_id}.json"
    stored = json.loads(path.read_text())
    assert stored["created_by"] == key_identity(world.write_key)
    old = {k: v for k, v in stored.items() if k not in ("created_at", "created_by", "labels", "reason", "probe_sets")}
    path.write_text(json.dumps(old))

    shown = stored_evaluations(world)[evaluation_id]
    assert "created_at" not in shown and "probe_sets" not in shown and shown["summary"] == job["result"]["summary"]
    parsed = EvaluationResult.model_validate(old)  # as the job reads a stored result it answers from storage
    assert parsed.created_at is None and parsed.probe_sets is None and parsed.labels is None
    assert evaluation_json(parsed) == old  # and serves it unchanged
    card = world.read.get(f"/variants/{world.variant_id}/model-card")
    assert card.status_code == 200 and f"- {evaluation_id[:12]}:" not in card.text


def test_without_keys_the_creator_is_anonymous(tmp_path: Path) -> None:
    variant_id = make_variant(tmp_path)
    with in_process_server(tmp_path, tmp_path / "models") as server:
        result = evaluate(another_client(server, {}), variant_id, {"retain": RETAIN})["result"]
    assert result["created_by"] == "anonymous" and result["labels"] == {}
    assert result["probe_sets"] == {"retain": {"sha256": sha256_of(RETAIN), "n": 2}}
