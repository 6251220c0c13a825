"""An unlearn without ``alpha`` through the real server (embedded mode) on a tiny Llama (issue 36).

Without a calibration it is built at the conservative α with a warning; after a calibration of the
same concepts in the same universe it is the calibration's recommended variant itself (same ID, a
variant the calibration job built independently); a request with ``alpha`` keeps the ID it always
had (the compose of ``-alpha``) and warns of nothing; a universe without a ``reference`` concept is
warned of, naming the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job
from tests.helpers.api import assert_problem, register_model, unchanged

MODEL = "default-alpha/tiny"
FACTS = make_facts(40, seed=13)
CONSERVATIVE = 0.25  # service.variants.default_alpha.CONSERVATIVE_ALPHA, stated independently
CONCEPTS = {  # name: (role, facts)
    "da-plain": ("target", (0, 6)),
    "da-calibrated": ("target", (6, 12)),
    "da-side": ("target", (12, 18)),
    "da-retain": ("reference", (18, 40)),
}


def probes(start: int, stop: int) -> list[dict[str, str]]:
    return [{"prompt": p, "completion": c} for p, c in FACTS[start:stop]]


@pytest.fixture(scope="module")
def api(live_server: LiveServer, tiny_llama_dir: Path) -> httpx.Client:
    client = live_server.client
    register_model(client, MODEL, f"file://{tiny_llama_dir}", existing_ok=True)
    for name, (role, (start, stop)) in CONCEPTS.items():
        body = {"name": name, "role": role, "models": [MODEL], "records": probes(start, stop)}
        response = client.post("/concepts", json=body)
        assert response.status_code == 202, response.text
    wait_concepts_ready(client, list(CONCEPTS), MODEL)
    return client


def post(api: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post(f"/models/{MODEL}/{path}", json=body)
    assert response.status_code in (200, 202), response.text
    return dict(response.json())


def test_without_alpha_or_calibration_the_conservative_alpha_is_used_and_said(api: httpx.Client) -> None:
    answer = post(api, "unlearn", {"concepts": ["da-plain"]})
    variant = answer["variant"]
    assert (variant["alpha"], variant["terms"]) == (CONSERVATIVE, {"da-plain": -CONSERVATIVE})
    [warning] = answer["warnings"]  # the universe holds da-retain, a reference: nothing else to say
    assert "alpha not given: used 0.25, the conservative default" in warning
    assert f"POST /models/{MODEL}/calibrate" in warning
    # The ID is a function of the α used: the compose of -0.25 is the same variant, and so is alpha 0.25.
    composed = post(api, "compose", {"terms": {"da-plain": -CONSERVATIVE}})
    explicit = post(api, "unlearn", {"concepts": ["da-plain"], "alpha": CONSERVATIVE})
    assert composed["variant"]["variant_id"] == explicit["variant"]["variant_id"] == variant["variant_id"]
    assert explicit["warnings"] == []


def test_a_request_with_alpha_keeps_its_id_and_warns_of_nothing(api: httpx.Client) -> None:
    answer = post(api, "unlearn", {"concepts": ["da-plain"], "alpha": 1.0})
    assert answer["warnings"] == []
    assert answer["variant"]["alpha"] == 1.0
    # The ID an unlearn with alpha always had: the compose of its coefficients.
    assert answer["variant"]["variant_id"] == post(api, "compose", {"terms": {"da-plain": -1.0}})["variant"]["variant_id"]
    default = post(api, "unlearn", {"concepts": ["da-plain"]})["variant"]["variant_id"]
    assert default != answer["variant"]["variant_id"]


def test_after_a_calibration_its_recommendation_is_used(api: httpx.Client) -> None:
    calibrate = {
        "concepts": ["da-calibrated"],
        "forget": probes(6, 10),
        "retain": probes(18, 26),
        "max_retain_nll_ratio": 50.0,  # loose: some candidate is recommended whatever the tiny model does
        "module_sets": ["all"],
        "scalings": ["weight_norm"],  # not the request's default: the adopted shape is visible
        "alpha_min": 0.1,
        "alpha_max": 2.0,
        "budget": 4,
    }
    submitted = post(api, "calibrate", calibrate)
    job = wait_for_job(api, submitted["job"]["job_id"], timeout=600)
    assert job["status"] == "succeeded", job
    recommended = job["result"]["recommended"]
    assert recommended is not None, job["result"]["note"]
    alpha = recommended["options"]["alpha"]

    answer = post(api, "unlearn", {"concepts": ["da-calibrated"]})
    variant = answer["variant"]
    # The calibration job built its recommendation as an unlearn variant: the same ID, α and shape.
    assert variant["variant_id"] == recommended["variant_id"]
    assert (variant["alpha"], variant["scaling"]) == (alpha, "weight_norm")
    [note] = answer["warnings"]
    assert submitted["calibration_id"] in note and "alpha not given" in note
    # Naming the same shape keeps the calibration; naming another one falls back, and says why.
    same = post(api, "unlearn", {"concepts": ["da-calibrated"], "scaling": "weight_norm"})
    assert same["variant"]["variant_id"] == recommended["variant_id"]
    other = post(api, "unlearn", {"concepts": ["da-calibrated"], "scaling": "uniform"})
    assert (other["variant"]["alpha"], other["variant"]["scaling"]) == (CONSERVATIVE, "uniform")
    [fallback] = other["warnings"]
    assert "conservative default" in fallback and submitted["calibration_id"] in fallback
    assert "scaling uniform" in fallback
    # Another concept set has no calibration: the conservative α.
    both = post(api, "unlearn", {"concepts": ["da-calibrated", "da-plain"]})
    assert both["variant"]["alpha"] == CONSERVATIVE


def test_a_universe_without_a_reference_is_warned_of_with_its_fix(api: httpx.Client) -> None:
    answer = post(api, "unlearn", {"concepts": ["da-plain"], "alpha": 0.5, "reference": ["da-side"]})
    [warning] = answer["warnings"]
    assert "no general-text reference" in warning and "da-plain, da-side" in warning
    assert '"role": "reference"' in warning
    with_reference = post(api, "unlearn", {"concepts": ["da-plain"], "alpha": 0.5, "reference": ["da-retain"]})
    assert with_reference["warnings"] == []


def test_a_bad_unlearn_without_alpha_is_refused_by_name_and_changes_nothing(
    api: httpx.Client, live_server: LiveServer
) -> None:
    with unchanged(live_server):
        assert_problem(api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["da-nope"]}), 404, "da-nope")
        assert_problem(api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["da-plain"], "alpha": 0}), 422, "alpha")
        null = api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["da-plain"], "alpha": None})
        assert_problem(null, 422, "alpha", "omit it")
