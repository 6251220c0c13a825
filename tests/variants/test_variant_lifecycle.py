"""Issue 39, the variant slice, through the HTTP API of a keyed server: metadata (labels, reason,
who, when) beside the variant and never in its ID, the signed receipt checked offline by
``engram verify`` (a real subprocess) against the downloaded files, and DELETE removing exactly the
objects the variant owned while another variant of the same universe stays whole and readable."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from api_schemas.variants import canonical_receipt_bytes
from engram_fixtures.demo import make_facts
from engram_fixtures.live import wait_concepts_ready, wait_for_job, wait_variant_ready
from service.api.auth import key_identity
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer, another_client, in_process_server
from tests.helpers.cli import failed, ok, run_cli, says

MODEL = "acme/lifecycle"
FACTS = make_facts(16, seed=11)
UNUSED_URL = "http://127.0.0.1:9"  # engram verify reads no server: nothing listens here


@dataclass
class World:
    server: InProcessServer
    write: httpx.Client
    other_write: httpx.Client
    read: httpx.Client
    admin: httpx.Client
    write_key: str
    public_pem: bytes


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from engram_fixtures.models import make_tiny_llama

    root = tmp_path_factory.mktemp("lifecycle")
    model_dir = make_tiny_llama(root / "models" / "tiny-llama", hidden=32, layers=2, tie_word_embeddings=True)
    signing = Ed25519PrivateKey.generate()
    key_file = root / "receipt-key.pem"
    key_file.write_bytes(
        signing.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public_pem = signing.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    read, write, other, admin = (secrets.token_urlsafe(24) for _ in range(4))
    keys = f"{read}:read,{write}:write,{other}:write,{admin}:admin"
    with in_process_server(root, root / "models", ENGRAM_API_KEYS=keys, ENGRAM_RECEIPT_SIGNING_KEY=str(key_file)) as server:
        write_client, other_client, read_client, admin_client = (
            another_client(server, {"Authorization": f"Bearer {k}"}) for k in (write, other, read, admin)
        )
        world = World(server, write_client, other_client, read_client, admin_client, write, public_pem)
        register_model(world.write, MODEL, f"file://{model_dir}")
        parts = (("lc-a", "target", FACTS[:4]), ("lc-b", "target", FACTS[4:8]), ("lc-ref", "reference", FACTS[8:]))
        for name, role, part in parts:
            records = [{"prompt": p, "completion": c} for p, c in part]
            body = {"name": name, "role": role, "models": [MODEL], "records": records}
            assert world.write.post("/concepts", json=body).status_code == 202
        wait_concepts_ready(world.write, ["lc-a", "lc-b", "lc-ref"], MODEL, timeout=600)
        yield world


def _unlearn(client: httpx.Client, concept: str, **extra: Any) -> dict[str, Any]:
    response = client.post(f"/models/{MODEL}/unlearn", json={"concepts": [concept], "alpha": 0.5, **extra})
    assert response.status_code in (200, 202), response.text
    return dict(response.json())


@pytest.fixture(scope="module")
def variants(world: World) -> tuple[dict[str, Any], dict[str, Any]]:
    """The labelled variant (lc-a, evaluated) and another of the same universe (lc-b)."""
    labelled = _unlearn(world.write, "lc-a", labels={"ticket": "T-42", "team": "privacy"}, reason="erasure request 42")
    first = wait_variant_ready(world.write, labelled["variant"]["variant_id"], timeout=600)
    second = wait_variant_ready(world.write, _unlearn(world.other_write, "lc-b")["variant"]["variant_id"], timeout=600)
    assert first["universe_id"] == second["universe_id"]
    probes = [{"prompt": p, "completion": c} for p, c in FACTS[:2]]
    response = world.write.post(f"/variants/{first['variant_id']}/evaluate", json={"forget": probes, "retain": probes})
    assert response.status_code in (200, 202), response.text
    assert wait_for_job(world.write, response.json()["job_id"], timeout=600)["status"] == "succeeded"
    return first, second


def _download(client: httpx.Client, variant: dict[str, Any], folder: Path) -> dict[str, str]:
    """Every file of the variant into ``folder``; path -> the sha256 of the bytes received."""
    digests = {}
    for entry in variant["files"]:
        response = client.get(f"/variants/{variant['variant_id']}/files/{entry['path']}")
        assert response.status_code == 200, response.text
        (folder / entry["path"]).parent.mkdir(parents=True, exist_ok=True)
        (folder / entry["path"]).write_bytes(response.content)
        digests[entry["path"]] = hashlib.sha256(response.content).hexdigest()
    return digests


def _store(world: World) -> set[str]:
    root = world.server.storage_dir
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_metadata_is_stored_beside_the_variant_and_filters_lists(world: World, variants: tuple[dict, dict]) -> None:
    first, second = variants
    assert first["labels"] == {"ticket": "T-42", "team": "privacy"}
    assert first["reason"] == "erasure request 42"
    assert first["created_by"] == key_identity(world.write_key)
    assert world.write_key not in json.dumps(first)
    assert second["labels"] == {} and second["created_by"] != first["created_by"]

    def listed(**query: Any) -> list[str]:
        response = world.read.get("/variants", params=query)
        assert response.status_code == 200, response.text
        return [v["variant_id"] for v in response.json()]

    ids = {first["variant_id"], second["variant_id"]}
    assert set(listed(model_id=MODEL)) == ids
    assert listed(label="ticket:T-42") == [first["variant_id"]]
    assert listed(label=["ticket:T-42", "team:other"]) == []
    assert listed(concept="lc-b") == [second["variant_id"]]
    assert set(listed(created_after=first["created_at"])) == ids
    assert listed(created_before=first["created_at"]) == []
    bad = world.read.get("/variants", params={"label": "ticket"})
    assert bad.status_code == 422 and "label=key:value" in bad.json()["detail"]

    # The same edit with other metadata is the same variant (metadata is not identity), answered with the first's.
    again = _unlearn(world.other_write, "lc-a", labels={"ticket": "T-99"}, reason="another reason")
    assert again["variant"]["variant_id"] == first["variant_id"]
    assert again["variant"]["labels"] == first["labels"] and again["variant"]["reason"] == first["reason"]


def test_the_receipt_verifies_offline_and_names_a_changed_file(
    world: World, variants: tuple[dict, dict], tmp_path: Path
) -> None:
    first, _ = variants
    answer = world.read.get(f"/variants/{first['variant_id']}/receipt")
    assert answer.status_code == 200, answer.text
    document = answer.json()
    receipt = document["receipt"]
    assert document["signed"] and document["algorithm"] == "Ed25519"
    # Independently: the signature is the operator's key's over the canonical JSON, and the digest is its sha256.
    body = json.dumps(receipt, sort_keys=True, separators=(",", ":")).encode()
    assert body == canonical_receipt_bytes(receipt)
    public = serialization.load_pem_public_key(world.public_pem)
    assert isinstance(public, Ed25519PublicKey)
    public.verify(base64.b64decode(document["signature"]), body)
    assert document["digest"] == hashlib.sha256(body).hexdigest()
    assert world.read.get("/receipt-key").json()["public_key"].encode() == world.public_pem
    assert receipt["request"]["reason"] == "erasure request 42" and receipt["request"]["labels"]["ticket"] == "T-42"
    concepts = {c["name"]: c for c in receipt["concepts"]}
    concept = world.read.get("/concepts/lc-a").json()
    assert concepts["lc-a"]["dataset_sha256"] == concept["dataset_digest"]
    assert concepts["lc-a"]["statistics_manifest_sha256"] is not None
    assert receipt["universe"]["universe_id"] == first["universe_id"]
    assert receipt["base_model"]["files"] and len(receipt["evaluations"]) == 1

    card = world.read.get(f"/variants/{first['variant_id']}/model-card")
    assert card.status_code == 200 and card.headers["content-type"].startswith("text/markdown"), card.text
    _, front, text = card.text.split("---\n", 2)
    assert yaml.safe_load(front) == {"base_model": MODEL, "tags": ["unlearning", "engram"]}
    assert concepts["lc-a"]["dataset_sha256"] in text and document["digest"] in text
    assert "erasure request 42" in text and "| forget |" in text  # the reason and the evaluation's figures

    folder = tmp_path / "variant"
    received = _download(world.read, first, folder)
    assert {f["path"]: f["sha256"] for f in receipt["files"]} == received
    saved = tmp_path / "receipt.json"
    saved.write_text(json.dumps(document))
    key_file = tmp_path / "public.pem"
    key_file.write_bytes(world.public_pem)

    assert says(ok(run_cli(UNUSED_URL, "verify", saved, folder, "--public-key", key_file)).stdout, "OK")
    embedded = ok(run_cli(UNUSED_URL, "verify", saved, folder))
    assert says(embedded.stderr, "proves integrity only")

    target = sorted(received)[0]
    data = bytearray((folder / target).read_bytes())
    data[len(data) // 2] ^= 0x01
    (folder / target).write_bytes(bytes(data))
    failed(run_cli(UNUSED_URL, "verify", saved, folder, "--public-key", key_file), target, "sha256")
    (folder / target).unlink()
    (folder / "extra.bin").write_bytes(b"x")
    failed(run_cli(UNUSED_URL, "verify", saved, folder, "--public-key", key_file), f"{target}: missing", "extra.bin")

    forged = {**document, "receipt": {**receipt, "request": {**receipt["request"], "reason": "nothing to see"}}}
    saved.write_text(json.dumps(forged))
    failed(run_cli(UNUSED_URL, "verify", saved, folder, "--public-key", key_file), "signature does not verify")


def test_a_revert_names_the_variant_it_reverts_in_its_receipt(world: World, variants: tuple[dict, dict]) -> None:
    first, _ = variants
    unknown = world.write.post(f"/models/{MODEL}/compose", json={"terms": {"lc-a": 0.5}, "reverts": "0" * 32})
    assert unknown.status_code == 404 and "reverts" in unknown.json()["detail"], unknown.text
    # Adding back what the first variant removed (c = +α on the base): a variant of its own, pointing back.
    body = {"terms": {"lc-a": 0.5}, "reverts": first["variant_id"], "reason": "erasure request 42 withdrawn"}
    answer = world.write.post(f"/models/{MODEL}/compose", json=body)
    assert answer.status_code in (200, 202), answer.text
    revert = wait_variant_ready(world.write, answer.json()["variant"]["variant_id"], timeout=600)
    assert revert["reverts"] == first["variant_id"] and revert["variant_id"] != first["variant_id"]
    receipt = world.read.get(f"/variants/{revert['variant_id']}/receipt").json()["receipt"]
    assert receipt["reverts"] == first["variant_id"] and receipt["request"]["terms"] == {"lc-a": 0.5}
    assert world.admin.delete(f"/variants/{revert['variant_id']}").status_code == 204  # an admin deletes any


def test_delete_is_refused_while_a_job_reads_the_variant(world: World, variants: tuple[dict, dict]) -> None:
    from service.jobs.records import EvaluatePayload
    from service.jobs.store import new_job

    first, _ = variants
    jobs = world.server.app.state.ctx.jobs
    # A queued evaluation of the variant, never dispatched: deterministic, unlike racing a real one.
    payload = EvaluatePayload(variant_id=first["variant_id"], probes_digest="0" * 64, evaluation_id="0" * 32)
    reader = jobs.create(new_job("evaluate", payload, unit="probes"))
    before = _store(world)
    try:
        refused = world.write.delete(f"/variants/{first['variant_id']}")
        assert refused.status_code == 409, refused.text
        assert reader.job_id in refused.json()["detail"] and "evaluate" in refused.json()["detail"]
        assert {k for k in before ^ _store(world) if not k.startswith(("audit/", "jobs/"))} == set()
    finally:
        jobs.update(reader.job_id, status="cancelled")


def test_delete_removes_what_the_variant_owned_and_nothing_else(
    world: World, variants: tuple[dict, dict], tmp_path: Path
) -> None:
    first, second = variants
    victim = first["variant_id"]
    for client, status in ((world.read, 403), (world.other_write, 403)):
        refused = client.delete(f"/variants/{victim}")
        assert refused.status_code == status, refused.text
    before = _store(world)
    answer = world.write.delete(f"/variants/{victim}")
    assert answer.status_code == 204, answer.text
    after = _store(world)
    gone = before - after
    assert {k for k in after - before if not k.startswith("audit/")} == set()  # nothing written but the audit log
    owned = {k for k in before if k.startswith((f"variants/{victim}/", f"variant-plans/{victim}."))}
    evaluations = {k for k in before if k.startswith("evaluations/")}
    assert {k for k in gone if not k.startswith("audit/")} == owned | evaluations
    assert any(k.endswith("/manifest.json") for k in owned) and any("/files/" in k for k in owned)
    assert any(k.startswith(f"universes/{first['universe_id']}/") for k in _store(world))

    assert world.read.get(f"/variants/{victim}").status_code == 404
    assert world.write.delete(f"/variants/{victim}").status_code == 404  # idempotent in effect; says it is gone
    assert victim not in {v["variant_id"] for v in world.read.get("/variants").json()}
    intact = world.read.get(f"/variants/{second['variant_id']}").json()
    assert intact["status"] == "ready"
    received = _download(world.read, intact, tmp_path / "second")
    assert received == {f["path"]: f["sha256"] for f in second["files"]}
