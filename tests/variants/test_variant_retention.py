"""ENGRAM_VARIANT_BYTES_BUDGET: after a build, the least recently downloaded variants are deleted
until the rest fits, never the new one nor one downloaded within READING_S; off by default."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import wait_concepts_ready, wait_variant_ready
from service.config import Settings
from service.variants.retention import HeldVariant, to_evict
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer, in_process_server

MODEL = "acme/retained"
FACTS = make_facts(16, seed=5)
NOW = datetime(2026, 11, 29, 9, 0, tzinfo=timezone.utc)


def _held(name: str, size: int, age_s: float, protected: bool = False) -> HeldVariant:
    return HeldVariant(name, size, NOW - timedelta(seconds=age_s), protected)


@pytest.mark.fast
def test_the_rule_evicts_least_recently_used_first_and_only_as_many_as_needed() -> None:
    held = [_held("old", 10, 300), _held("busy", 10, 200, protected=True), _held("mid", 10, 100), _held("new", 10, 0)]
    assert to_evict(held, budget=30, retention_s=0, now=NOW, keep="new") == ["old"]
    assert to_evict(held, budget=15, retention_s=0, now=NOW, keep="new") == ["old", "mid"]  # busy stays, over budget
    assert to_evict(held, budget=0, retention_s=150, now=NOW, keep=None) == ["old"]  # busy is older, but protected
    assert to_evict(held, budget=0, retention_s=0, now=NOW, keep=None) == []  # no bound: nothing


@pytest.mark.fast
def test_both_bounds_are_off_by_default() -> None:
    fields = Settings.model_fields
    assert fields["variant_bytes_budget"].default == 0 and fields["variant_retention_s"].default == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    from engram_fixtures.models import make_tiny_llama

    root = tmp_path_factory.mktemp("retention")
    model_dir = make_tiny_llama(root / "models" / "tiny-llama", hidden=32, layers=2, tie_word_embeddings=True)
    # One checkpoint of this model is ~40 kB: a budget of 1.5 of them holds one variant, not two.
    with in_process_server(root, root / "models", ENGRAM_VARIANT_BYTES_BUDGET="1") as server:
        register_model(server.client, MODEL, f"file://{model_dir}")
        parts = (("rt-a", "target", FACTS[:4]), ("rt-b", "target", FACTS[4:8]), ("rt-ref", "reference", FACTS[8:]))
        for name, role, part in parts:
            records = [{"prompt": p, "completion": c} for p, c in part]
            body = {"name": name, "role": role, "models": [MODEL], "records": records}
            assert server.client.post("/concepts", json=body).status_code == 202
        wait_concepts_ready(server.client, ["rt-a", "rt-b", "rt-ref"], MODEL, timeout=600)
        yield server


def _built(server: InProcessServer, concept: str, alpha: float) -> dict[str, Any]:
    response = server.client.post(f"/models/{MODEL}/unlearn", json={"concepts": [concept], "alpha": alpha})
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(server.client, response.json()["variant"]["variant_id"], timeout=600)


def _wait_gone(server: InProcessServer, variant_id: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while server.client.get(f"/variants/{variant_id}").status_code != 404:
        assert time.monotonic() < deadline, f"variant {variant_id} still answered after {timeout} s"
        time.sleep(0.1)


def _files(server: InProcessServer, variant_id: str) -> list[Path]:
    return sorted(p for p in (server.storage_dir / "variants" / variant_id).rglob("*") if p.is_file())


def test_a_build_over_budget_deletes_the_least_recently_downloaded_never_a_recent_one(server: InProcessServer) -> None:
    # With a 1-byte budget every other variant is over it: only protection keeps one.
    first = _built(server, "rt-a", 0.5)
    entry = first["files"][0]
    assert server.client.get(f"/variants/{first['variant_id']}/files/{entry['path']}").status_code == 200
    second = _built(server, "rt-b", 0.5)  # first was downloaded just now: being read, kept
    assert server.client.get(f"/variants/{first['variant_id']}").json()["status"] == "ready"

    third = _built(server, "rt-a", 0.75)  # second was never downloaded: the least recently used unprotected one
    _wait_gone(server, second["variant_id"])  # deleted by the job process: this process caches a request 1 s
    assert _files(server, second["variant_id"]) == []
    assert not (server.storage_dir / "variant-plans" / f"{second['variant_id']}.json").exists()
    for kept in (first, third):
        assert server.client.get(f"/variants/{kept['variant_id']}").json()["status"] == "ready"

    again = _built(server, "rt-b", 0.5)  # the same request builds it again under the same ID
    assert again["variant_id"] == second["variant_id"]
    assert {f["sha256"] for f in again["files"]} == {f["sha256"] for f in second["files"]}


def test_without_a_signing_key_receipts_say_they_are_unsigned(server: InProcessServer) -> None:
    variant = _built(server, "rt-a", 0.25)
    answer = server.client.get(f"/variants/{variant['variant_id']}/receipt").json()
    assert answer["signed"] is False and answer["signature"] is None and "ENGRAM_RECEIPT_SIGNING_KEY" in answer["note"]
    assert server.client.get("/receipt-key").status_code == 404


@pytest.mark.fast
def test_a_signing_key_that_is_not_an_ed25519_pem_is_refused_by_name(tmp_path: Path) -> None:
    from service.errors import ServiceUnavailable
    from service.variants.receipt import signing_key

    (tmp_path / "garbage.pem").write_text("not a key")
    for configured in (str(tmp_path / "garbage.pem"), str(tmp_path / "absent.pem"), "-----BEGIN PRIVATE KEY-----\nx"):
        with pytest.raises(ServiceUnavailable, match="ENGRAM_RECEIPT_SIGNING_KEY"):
            signing_key(configured)
    assert signing_key(None) is None and signing_key("") is None
