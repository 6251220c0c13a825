"""POST /models/{id}/calibrate through the real server (embedded mode) on a tiny Llama.

Bad requests are a 4xx problem naming what is wrong and store nothing; a calibration runs as a job
counting candidates, answers the same request from storage, and stops when cancelled.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job
from tests.helpers.api import READ_CACHE_S, assert_problem, unchanged

MODEL = "cal/tiny"
FACTS = make_facts(40, seed=11)


def probes(start: int, stop: int) -> list[dict[str, str]]:
    return [{"prompt": p, "completion": c} for p, c in FACTS[start:stop]]


@pytest.fixture(scope="module")
def api(live_server: LiveServer, tiny_llama_dir: Path) -> httpx.Client:
    """``cal/tiny`` registered with ``cal-forget`` (target) and ``cal-retain`` (reference) ready on it."""
    client = live_server.client
    response = client.post("/models", json={"model_id": MODEL, "source": f"file://{tiny_llama_dir}"})
    assert response.status_code in (200, 201, 202), response.text
    if response.status_code == 202:  # the register job ran past the request's wait (under load)
        assert wait_for_job(client, response.json()["job_id"], timeout=300)["status"] == "succeeded"
    for name, role, (start, stop) in (("cal-forget", "target", (0, 6)), ("cal-retain", "reference", (6, 40))):
        body = {"name": name, "role": role, "models": [MODEL], "records": probes(start, stop)}
        response = client.post("/concepts", json=body)
        assert response.status_code == 202, response.text
    wait_concepts_ready(client, ["cal-forget", "cal-retain"], MODEL)
    return client


def body(**changes: Any) -> dict[str, Any]:
    request = {"concepts": ["cal-forget"], "forget": probes(0, 3), "retain": probes(6, 12), "budget": 4}
    return {**request, **changes}


@pytest.mark.parametrize(
    ("path", "request_body", "status", "mentions"),
    [
        (f"/models/{MODEL}/calibrate", body(forget=[]), 422, ["forget"]),
        (f"/models/{MODEL}/calibrate", body(retain=[{"prompt": "Q: a? A:"}]), 422, ["completion"]),
        (f"/models/{MODEL}/calibrate", body(forget=[{"prompt": "", "completion": " x"}]), 422, ["forget"]),
        (f"/models/{MODEL}/calibrate", body(alpha_min=2.0, alpha_max=1.0), 422, ["alpha_min"]),
        (f"/models/{MODEL}/calibrate", body(budget=0), 422, ["budget"]),
        (f"/models/{MODEL}/calibrate", body(max_retain_nll_ratio=0.5), 422, ["max_retain_nll_ratio"]),
        (f"/models/{MODEL}/calibrate", body(scalings=["uniform", "uniform"]), 422, ["twice"]),
        (f"/models/{MODEL}/calibrate", body(module_sets=["everything"]), 422, ["module_sets"]),
        (f"/models/{MODEL}/calibrate", body(module_sets=[["nope_proj"]]), 422, ["nope_proj"]),
        (f"/models/{MODEL}/calibrate", body(layer_sets=[[0, 99]]), 422, ["99"]),
        (f"/models/{MODEL}/calibrate", body(lora_rank=8), 422, ["lora_rank"]),
        (f"/models/{MODEL}/calibrate", body(concepts=["cal-forget", "no-such-concept"]), 404, ["no-such-concept"]),
        ("/models/no/such-model/calibrate", body(), 404, ["no/such-model"]),
        (f"/models/{MODEL}/calibrate", body(universe="0" * 32), 404, ["0" * 32]),
    ],
)
def test_a_bad_calibration_request_is_a_problem_naming_it_and_stores_nothing(
    api: httpx.Client, live_server: LiveServer, path: str, request_body: dict[str, Any], status: int, mentions: list[str]
) -> None:
    with unchanged(live_server):
        assert_problem(api.post(path, json=request_body), status, *mentions)


def test_unknown_calibrations_are_404(api: httpx.Client) -> None:
    assert_problem(api.get("/calibrations/" + "f" * 32), 404, "f" * 32)
    assert_problem(api.get("/calibrations/" + "f" * 32 + "/front.png"), 404, "f" * 32)
    assert_problem(api.get("/calibrations/not-an-id"), 404, "not-an-id")


def test_a_calibration_counts_candidates_answers_again_from_storage_and_builds_its_recommendation(
    api: httpx.Client,
) -> None:
    request = body(module_sets=["all", "qk_gate"], scalings=["uniform"], max_retain_nll_ratio=3.0, budget=6)
    submitted = api.post(f"/models/{MODEL}/calibrate", json=request)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(api, submitted.json()["job"]["job_id"], timeout=300)
    assert job["status"] == "succeeded", job
    assert job["kind"] == "calibrate" and job["model_id"] == MODEL
    result = job["result"]
    assert job["progress"] == {"done": result["evaluations"], "total": result["evaluations"], "unit": "candidates"}
    assert 1 <= result["evaluations"] <= 6
    assert result["arms"] == ["all/uniform", "qk_gate/uniform"]
    assert [c["index"] for c in result["candidates"]] == list(range(result["evaluations"]))
    assert result["candidates"][0]["options"]["alpha"] == 1.0  # every arm starts at the paper's α = 1
    for candidate in result["candidates"]:
        assert candidate["feasible"] == (candidate["retain"]["nll_ratio"] <= 3.0)
    if result["recommended"] is not None:
        variant = api.get(f"/variants/{result['recommended']['variant_id']}").json()
        assert variant["status"] == "ready"
        assert variant["terms"] == {"cal-forget": -result["recommended"]["options"]["alpha"]}
        assert variant["universe_id"] == result["universe_id"]
    else:
        assert "no candidate keeps the retain NLL ratio" in result["note"]
    png = api.get(result["front_png"])
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG\r\n\x1a\n")

    again = api.post(f"/models/{MODEL}/calibrate", json=request)
    assert again.status_code == 200, again.text
    assert again.json() == {**submitted.json(), "job": again.json()["job"]}
    assert again.json()["job"]["job_id"] == job["job_id"] and again.json()["job"]["status"] == "succeeded"
    other = api.post(f"/models/{MODEL}/calibrate", json={**request, "max_retain_nll_ratio": 2.5})
    assert other.status_code == 202 and other.json()["calibration_id"] != submitted.json()["calibration_id"]
    wait_for_job(api, other.json()["job"]["job_id"], timeout=300)


def test_a_cancelled_calibration_stops_and_a_new_request_runs_it_again(api: httpx.Client, live_server: LiveServer) -> None:
    many = [{"prompt": f"Q: what is item {i}? A:", "completion": f" thing {i}"} for i in range(300)]
    request = body(retain=many, budget=200, alpha_min=0.001, alpha_max=100.0)
    submitted = api.post(f"/models/{MODEL}/calibrate", json=request)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["job"]["job_id"]
    deadline = time.monotonic() + 120
    while api.get(f"/jobs/{job_id}").json()["status"] == "queued" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert api.delete(f"/jobs/{job_id}").status_code == 200
    job = wait_for_job(api, job_id, timeout=120)
    assert job["status"] == "cancelled", job
    calibration_id = submitted.json()["calibration_id"]
    assert not (live_server.storage_dir / "calibrations" / calibration_id / "result.json").exists()
    assert api.get(f"/calibrations/{calibration_id}").json()["status"] == "cancelled"
    again = api.post(f"/models/{MODEL}/calibrate", json=request)
    assert again.status_code == 202 and again.json()["job"]["job_id"] != job_id
    assert api.delete(f"/jobs/{again.json()['job']['job_id']}").status_code == 200
    assert wait_for_job(api, again.json()["job"]["job_id"], timeout=120)["status"] == "cancelled"


def test_a_data_weighted_calibration_shows_the_maps_strengths_and_builds_them_into_its_variant(
    api: httpx.Client,
) -> None:
    """The ``data_weighted`` arm's strengths are the data-weighted map's module-type means (relative to
    the largest), shown on every candidate; the recommended variant carries them and measures as its
    candidate did."""
    request = body(module_sets=["data_weighted"], scalings=["weight_norm"], max_retain_nll_ratio=1e4, budget=3)
    submitted = api.post(f"/models/{MODEL}/calibrate", json=request)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(api, submitted.json()["job"]["job_id"], timeout=300)
    assert job["status"] == "succeeded", job
    result = job["result"]
    assert result["arms"] == ["data_weighted/weight_norm"]
    strengths = result["candidates"][0]["options"]["module_strengths"]
    assert all(c["options"]["module_strengths"] == strengths for c in result["candidates"])
    assert all(c["options"]["modules"] is None for c in result["candidates"])

    query = {"concepts": "cal-forget", "reference": ",".join(result["reference"]), "measure": "data"}
    mapped = api.get(f"/models/{MODEL}/engram-map", params=query).json()
    means = {
        module: sum(row[i] for row in mapped["maps"]["cal-forget"]["rho"]) / len(mapped["blocks"])
        for i, module in enumerate(mapped["modules"])
    }
    means.update(mapped["outside_blocks"]["cal-forget"])
    top = max(means.values())
    assert set(strengths) == set(means) and max(strengths.values()) == 1.0
    for module, mean in means.items():
        assert strengths[module] == pytest.approx(max(mean / top, 1e-3), rel=2e-3), module  # 3 significant figures

    recommended = result["recommended"]
    assert recommended is not None, result["note"]
    variant = api.get(f"/variants/{recommended['variant_id']}").json()
    assert variant["status"] == "ready" and variant["scaling"] == "weight_norm"
    assert variant["module_strengths"] == {k: v for k, v in sorted(strengths.items()) if v != 1.0}
    chosen = result["candidates"][recommended["candidate"]]
    scored = api.post(
        f"/variants/{variant['variant_id']}/evaluate?wait=60",
        json={"forget": request["forget"], "retain": request["retain"]},
    )
    assert scored.status_code == 200, scored.text
    for split in ("forget", "retain"):
        assert scored.json()["result"]["summary"]["variant"][split]["mean_nll"] == pytest.approx(
            chosen[split]["mean_nll"], rel=1e-5
        )


def test_the_calibrations_list_pages_filters_by_model_and_shows_each_recommendations_headline(
    api: httpx.Client,
) -> None:
    """``GET /calibrations``: each calibration once across pages, the model filter (404 for an unknown
    model), and, once done, the count of candidates and the recommendation's headline as the full
    result gives it."""
    request = body(module_sets=["all"], scalings=["uniform"], max_retain_nll_ratio=1e4, budget=2)
    submitted = api.post(f"/models/{MODEL}/calibrate", json=request)
    assert submitted.status_code in (200, 202), submitted.text
    calibration_id = submitted.json()["calibration_id"]
    assert wait_for_job(api, submitted.json()["job"]["job_id"], timeout=300)["status"] == "succeeded"
    time.sleep(READ_CACHE_S)  # the listing is served as of at most a second ago

    listed = api.get("/calibrations", params={"model_id": MODEL})
    assert listed.status_code == 200, listed.text
    entries = {c["calibration_id"]: c for c in listed.json()}
    assert all(c["model_id"] == MODEL for c in entries.values())
    entry, full = entries[calibration_id], api.get(f"/calibrations/{calibration_id}").json()
    assert entry["status"] == "succeeded" and entry["concepts"] == ["cal-forget"]
    assert entry["job_id"] == submitted.json()["job"]["job_id"] and entry["created_at"]
    assert entry["universe_id"] == full["universe_id"]
    assert entry["candidates"] == full["result"]["evaluations"] == len(full["result"]["candidates"])
    recommended = full["result"]["recommended"]
    assert recommended is not None, full["result"]["note"]  # a bound of 1e4 admits every candidate
    headline = {k: recommended[k] for k in entry["recommended"]}
    assert entry["recommended"] == headline and headline["variant_id"] == recommended["variant_id"]

    paged, cursor = [], None
    while True:
        page = api.get("/calibrations", params={"limit": 1, **({"cursor": cursor} if cursor else {})})
        assert page.status_code == 200 and len(page.json()) <= 1, page.text
        paged += [c["calibration_id"] for c in page.json()]
        cursor = page.headers.get("X-Next-Cursor")
        if cursor is None:
            break
    assert paged == sorted(set(paged)) and set(entries) <= set(paged)
    assert_problem(api.get("/calibrations", params={"model_id": "no/such-model"}), 404, "no/such-model")
    assert_problem(api.get("/calibrations", params={"cursor": "nonsense"}), 400, "cursor")
