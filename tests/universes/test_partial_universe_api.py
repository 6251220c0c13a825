"""A request waits only for what it needs, through the live server (embedded mode) on a tiny Llama:
a Q/K+Gate unlearn request on a new universe answers with its job's progress naming the groups it
built and those it deferred (down_proj's among them), the universe shows ``partial``; the engram map
of the same concepts works on it, and a calibration on it builds the deferred groups it needs (the
universe is ``ready`` after). The stored parts and the variants' exactness are
``tests/universes/test_universe_stages.py``'s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, wait_for_job, wait_variant_ready
from tests.helpers.api import model_with_concepts

MODEL = "stages/tiny"
FACTS = make_facts(40, seed=13)
CONCEPTS = ["st-forget", "st-retain"]


def probes(start: int, stop: int) -> list[dict[str, str]]:
    return [{"prompt": p, "completion": c} for p, c in FACTS[start:stop]]


@pytest.fixture(scope="module")
def api(live_server: LiveServer, tiny_llama_dir: Path) -> httpx.Client:
    concepts: dict[str, tuple[str | None, list[dict[str, Any]]]] = {
        "st-forget": ("target", probes(0, 6)),
        "st-retain": ("reference", probes(6, 40)),
    }
    model_with_concepts(live_server.client, MODEL, f"file://{tiny_llama_dir}", concepts)
    return live_server.client


@pytest.fixture(scope="module")
def partial(api: httpx.Client) -> dict[str, Any]:
    """The Q/K+Gate unlearn request on a new universe, its job finished."""
    body = {"concepts": ["st-forget"], "alpha": 1.0, "reference": CONCEPTS, "modules": ["q_proj", "k_proj", "gate_proj"]}
    response = api.post(f"/models/{MODEL}/unlearn", json=body)
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["job"]["job_id"], timeout=300)
    assert job["status"] == "succeeded", job
    variant = wait_variant_ready(api, response.json()["variant"]["variant_id"])
    return {"job": job, "variant": variant}


def _universe(api: httpx.Client, universe_id: str) -> dict[str, Any]:
    [found] = [u for u in api.get(f"/models/{MODEL}/universes").json() if u["universe_id"] == universe_id]
    return found


def test_the_job_progress_names_built_and_deferred_groups(api: httpx.Client, partial: dict[str, Any]) -> None:
    groups = partial["job"]["progress"]["groups"]
    assert any(g.endswith("down_proj") for g in groups["deferred"]), groups
    assert not any(g.endswith("down_proj") for g in groups["built"]), groups
    assert any(g.endswith("q_proj") for g in groups["built"]) and len(groups["built"]) == 4, groups  # 2 layers × 2
    universe = _universe(api, partial["variant"]["universe_id"])
    assert universe["status"] == "partial", universe
    assert universe["groups"]["done"] == 4 and universe["groups"]["total"] == 4 + len(groups["deferred"])


def test_the_engram_map_works_on_a_partial_universe(api: httpx.Client, partial: dict[str, Any]) -> None:
    params = {"concepts": "st-forget", "reference": ",".join(CONCEPTS)}
    deadline = time.monotonic() + 300
    response = api.get(f"/models/{MODEL}/engram-map", params=params)
    while response.status_code == 202 and time.monotonic() < deadline:
        time.sleep(0.5)
        response = api.get(f"/models/{MODEL}/engram-map", params=params)
    assert response.status_code == 200, response.text
    assert "mlp.down_proj" in response.json()["modules"]


def test_a_calibration_on_a_partial_universe_builds_what_it_needs(api: httpx.Client, partial: dict[str, Any]) -> None:
    universe_id = partial["variant"]["universe_id"]
    request = {
        "concepts": ["st-forget"],
        "forget": probes(0, 3),
        "retain": probes(6, 12),
        "budget": 2,
        "universe": universe_id,
        "module_sets": ["all"],
        "scalings": ["uniform"],
    }
    submitted = api.post(f"/models/{MODEL}/calibrate", json=request)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(api, submitted.json()["job"]["job_id"], timeout=300)
    assert job["status"] == "succeeded", job
    assert job["result"]["universe_id"] == universe_id
    assert _universe(api, universe_id)["status"] == "ready"
