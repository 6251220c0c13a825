"""Universes through the real server: build one, see it, use it; the same request keeps its variant;
their bytes in the API and /metrics; a universe over the storage budget is a 409 that changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, running_server, wait_concepts_ready, wait_for_job, wait_variant_ready
from tests.helpers.api import assert_problem, model_with_concepts

MODEL = "uni/tiny"
FACTS = make_facts(60, seed=4)


def records(start: int, stop: int) -> list[dict[str, str]]:
    return [{"prompt": p, "completion": c} for p, c in FACTS[start:stop]]


@pytest.fixture(scope="module")
def api(live_server: LiveServer, tiny_llama_dir: Path) -> httpx.Client:
    """``uni/tiny`` registered with concepts ``uni-forget`` and ``uni-retain`` ready on it."""
    concepts: dict[str, tuple[str | None, list[dict[str, Any]]]] = {
        "uni-forget": (None, records(0, 4)),
        "uni-retain": (None, records(4, 20)),
    }
    model_with_concepts(live_server.client, MODEL, f"file://{tiny_llama_dir}", concepts)
    return live_server.client


@pytest.fixture(scope="module")
def built(api: httpx.Client) -> dict[str, Any]:
    """The first POST /models/uni/tiny/universes (every ready concept) and its finished job."""
    response = api.post(f"/models/{MODEL}/universes", json={})
    assert response.status_code == 202, response.text
    return {"response": response.json(), "job": wait_for_job(api, response.json()["job"]["job_id"])}


def test_posting_a_universe_builds_it_and_makes_it_current(api: httpx.Client, built: dict[str, Any]) -> None:
    submitted = built["response"]
    universe = submitted["universe"]
    assert universe["status"] == "building" and universe["current"] is True
    assert sorted(m["name"] for m in universe["members"]) == ["uni-forget", "uni-retain"]
    assert submitted["job"]["kind"] == "universe" and submitted["job"]["model_id"] == MODEL
    job = built["job"]
    assert job["status"] == "succeeded", job
    assert job["progress"]["done"] == job["progress"]["total"] > 0
    shown = api.get(f"/universes/{universe['universe_id']}")
    assert shown.status_code == 200, shown.text
    ready = shown.json()
    assert ready["status"] == "ready" and ready["current"] is True
    assert ready["groups"]["done"] == ready["groups"]["total"] > 0
    assert ready["bytes"] > 0
    assert set(ready["build_seconds"]) == {"decomposition", "engrams", "total"}
    listed = api.get(f"/models/{MODEL}/universes")
    assert listed.status_code == 200, listed.text
    assert [u["universe_id"] for u in listed.json() if u["current"]] == [universe["universe_id"]]
    again = api.post(f"/models/{MODEL}/universes", json={})
    assert again.status_code == 200, again.text
    assert again.json()["job"] is None and again.json()["universe"]["universe_id"] == universe["universe_id"]


def test_an_unrelated_upload_does_not_change_the_answer(api: httpx.Client, built: dict[str, Any]) -> None:
    current = built["response"]["universe"]["universe_id"]
    body = {"concepts": ["uni-forget"], "alpha": 1.0}
    first = api.post(f"/models/{MODEL}/unlearn", json=body)
    assert first.status_code == 202, first.text
    variant = wait_variant_ready(api, first.json()["variant"]["variant_id"])
    assert variant["universe_id"] == current
    assert variant["reference"] == ["uni-forget", "uni-retain"]
    upload = api.post("/concepts", json={"name": "uni-unrelated", "models": [MODEL], "records": records(20, 40)})
    assert upload.status_code == 202, upload.text
    wait_concepts_ready(api, ["uni-unrelated"], MODEL)
    again = api.post(f"/models/{MODEL}/unlearn", json=body)
    assert again.status_code == 200, again.text
    assert again.json()["variant"]["variant_id"] == variant["variant_id"]

    advanced = api.post(f"/models/{MODEL}/universes", json={})  # now with uni-unrelated
    assert advanced.status_code == 202, advanced.text
    wait_for_job(api, advanced.json()["job"]["job_id"])
    moved = api.post(f"/models/{MODEL}/unlearn", json=body)
    assert moved.status_code == 202, moved.text
    assert moved.json()["variant"]["universe_id"] == advanced.json()["universe"]["universe_id"]
    assert wait_variant_ready(api, moved.json()["variant"]["variant_id"])["variant_id"] != variant["variant_id"]
    old = api.post(f"/models/{MODEL}/unlearn", json={**body, "universe": current})
    assert old.status_code == 200 and old.json()["variant"]["variant_id"] == variant["variant_id"], old.text


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "mention"),
    [
        ("GET", "/universes/0123456789abcdef0123456789abcdef", None, 404, "0123456789abcdef"),
        ("GET", "/universes/not-a-universe", None, 404, ""),
        ("GET", "/models/uni/missing/universes", None, 404, "uni/missing"),
        ("POST", "/models/uni/missing/universes", {}, 404, "uni/missing"),
        ("POST", f"/models/{MODEL}/universes", {"concepts": ["uni-ghost"]}, 404, "uni-ghost"),
        ("POST", f"/models/{MODEL}/universes", {"concepts": []}, 422, "concepts"),
        ("POST", f"/models/{MODEL}/universes", {"rcond": 2.0}, 422, "rcond"),
        ("POST", f"/models/{MODEL}/unlearn", {"concepts": ["uni-forget"], "universe": "0" * 32}, 404, "0" * 32),
        ("POST", f"/models/{MODEL}/unlearn", {"concepts": ["uni-forget"], "universe": "latest"}, 422, "universe"),
        ("GET", "/universes/usage?model_id=uni/missing", None, 404, "uni/missing"),
    ],
)
def test_bad_universe_requests_are_problems(
    api: httpx.Client, built: dict[str, Any], method: str, path: str, body: Any, status: int, mention: str
) -> None:
    assert_problem(api.request(method, path, json=body), status, *([mention] if mention else []))


def _gauges(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_bytes_show_on_universes_their_totals_and_metrics(api: httpx.Client, built: dict[str, Any]) -> None:
    universe = api.get(f"/universes/{built['response']['universe']['universe_id']}").json()
    detail = universe["bytes_detail"]
    assert detail["groups"] > 0 and detail["engrams"] > 0
    assert detail["groups"] + detail["engrams"] == detail["total"] == universe["bytes"]
    assert universe["projected_bytes"] >= universe["bytes"], "the projection is an upper bound"
    assert universe["last_used"] is not None and universe["evicted_at"] is None

    listed = api.get(f"/models/{MODEL}/universes").json()
    usage = api.get("/universes/usage", params={"model_id": MODEL})
    assert usage.status_code == 200, usage.text
    totals = usage.json()
    ready = [u for u in listed if u["status"] == "ready"]
    assert totals["model_id"] == MODEL and totals["universes"]["ready"] == len(ready) >= 1
    assert totals["bytes"]["groups"] == sum(u["bytes_detail"]["groups"] for u in ready)
    assert totals["bytes"]["engrams"] == sum(u["bytes_detail"]["engrams"] for u in ready)
    assert totals["configured_budget_bytes"] == 256 << 30, "the default budget"
    # In force: capped to half the store's volume where that is smaller (issue 23, finding 6).
    assert totals["budget_bytes"] == min(256 << 30, int(totals["volume_bytes"] * 0.5))

    everything = api.get("/universes/usage").json()
    gauges = _gauges(api.get("/metrics").text)
    assert gauges[("engram_universe_bytes", (("part", "groups"),))] == everything["bytes"]["groups"]
    assert gauges[("engram_universe_bytes", (("part", "engrams"),))] == everything["bytes"]["engrams"]
    assert gauges[("engram_universe_budget_bytes", ())] == everything["budget_bytes"], "the budget in force"
    assert gauges[("engram_universes", (("status", "ready"),))] == everything["universes"]["ready"]


# ---------------------------------------------------------------- over the budget


def _stored(root: Path) -> dict[str, int]:
    """Every stored object and its size (what a refused request must leave as it was)."""
    # the audit log records a refused request by design (service/api/audit.py): it is not what the refusal changed
    files = (p for p in root.rglob("*") if p.is_file() and ".tmp" not in p.parts and p.relative_to(root).parts[0] != "audit")
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in files}


BUDGET = 4096  # bytes: less than any universe of the tiny model


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama_dir: Path) -> Any:
    """A server of its own with a 4 KiB universe budget, ``tight/tiny`` and one concept ready on it."""
    root = tmp_path_factory.mktemp("tight")
    with running_server(root, model_root, ENGRAM_UNIVERSE_BYTES_BUDGET=str(BUDGET)) as live:
        client = live.client
        response = client.post("/models", json={"model_id": "tight/tiny", "source": f"file://{tiny_llama_dir}"})
        assert response.status_code in (200, 201), response.text
        response = client.post("/concepts", json={"name": "tight-c", "models": ["tight/tiny"], "records": records(0, 4)})
        assert response.status_code == 202, response.text
        wait_concepts_ready(client, ["tight-c"], "tight/tiny")
        yield live


def test_a_universe_over_the_budget_is_a_409_and_nothing_is_built(tight: LiveServer) -> None:
    client = tight.client
    before = _stored(tight.storage_dir)
    refused = client.post("/models/tight/tiny/universes", json={})
    problem = assert_problem(refused, 409, "ENGRAM_UNIVERSE_BYTES_BUDGET", "tight/tiny", "Nothing was built")
    assert problem["type"].endswith("/universe-budget-exceeded")
    assert problem["budget_bytes"] == BUDGET and problem["projected_bytes"] > BUDGET
    assert f"{problem['projected_bytes']} bytes" in problem["detail"]
    unlearn = client.post("/models/tight/tiny/unlearn", json={"concepts": ["tight-c"]})  # would build it too
    assert_problem(unlearn, 409, "ENGRAM_UNIVERSE_BYTES_BUDGET")
    assert _stored(tight.storage_dir) == before, "no job, no universe request, no current universe, no variant"
    assert client.get("/models/tight/tiny/universes").json() == []
    usage = client.get("/universes/usage").json()
    assert usage["bytes"]["total"] == usage["reserved_bytes"] == 0 and usage["budget_bytes"] == BUDGET
    assert _gauges(client.get("/metrics").text)[("engram_universe_budget_refusals_total", ())] == 2
