"""POST /models/{id}/calibrate with an objective (issue 26), through the real server on a tiny Llama.

What cannot be measured is refused at submission, naming the metric and what it needs; a run
reports every candidate's objective and constraint metrics, recommends the best feasible one by
the objective, checks it on held-out probes, and plots any two of its metrics.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts, tofu_answers
from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job
from tests.helpers.api import assert_problem, unchanged

MODEL = "cal/goal"
FACTS = make_facts(40, seed=11)
EXTRA = tofu_answers(FACTS, 11)


def probes(start: int, stop: int, tofu: bool = True) -> list[dict[str, Any]]:
    out = []
    for (p, c), (para, wrong) in zip(FACTS[start:stop], EXTRA[start:stop], strict=True):
        probe: dict[str, Any] = {"prompt": p, "completion": c}
        if tofu:
            probe |= {"paraphrased_answer": para, "perturbed_answers": list(wrong)}
        out.append(probe)
    return out


def register(client: httpx.Client, model_id: str, folder: Path) -> None:
    """Register a model, waiting for its register job when it ran past the request's wait (202 under load)."""
    response = client.post("/models", json={"model_id": model_id, "source": f"file://{folder}"})
    assert response.status_code in (200, 201, 202), response.text
    if response.status_code == 202:
        assert wait_for_job(client, response.json()["job_id"], timeout=300)["status"] == "succeeded"


@pytest.fixture(scope="module")
def api(live_server: LiveServer, tiny_llama_dir: Path) -> httpx.Client:
    """``cal/goal`` registered with ``goal-forget`` (target) and ``goal-retain`` (reference) ready on it."""
    client = live_server.client
    register(client, MODEL, tiny_llama_dir)
    for name, role, (start, stop) in (("goal-forget", "target", (0, 6)), ("goal-retain", "reference", (6, 40))):
        records = [{"prompt": p["prompt"], "completion": p["completion"]} for p in probes(start, stop, tofu=False)]
        response = client.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": records})
        assert response.status_code == 202, response.text
    wait_concepts_ready(client, ["goal-forget", "goal-retain"], MODEL)
    return client


def body(**changes: Any) -> dict[str, Any]:
    request = {
        "concepts": ["goal-forget"],
        "forget": probes(0, 6),
        "retain": probes(6, 14),
        "budget": 4,
        "module_sets": ["all"],
        "scalings": ["uniform"],
        "objective": {"maximize": "overall"},
        "retain_model": MODEL,
        "constraints": [{"metric": "model_utility", "min_ratio_to_base": 0.5}],
    }
    return {**request, **changes}


def _without(key: str) -> dict[str, Any]:
    request = body()
    del request[key]
    return request


@pytest.mark.parametrize(
    ("request_body", "status", "mentions"),
    [
        (body(objective={"maximize": "no_such_score"}), 422, ["no_such_score"]),
        (body(constraints=[{"metric": "utilty", "min": 0.1}]), 422, ["utilty"]),
        (body(constraints=[{"metric": "model_utility"}]), 422, ["model_utility", "no bound"]),
        (body(objective={"maximize": "overall", "minimize": "privacy"}), 422, ["objective"]),
        (_without("retain_model"), 422, ["overall", "retain model"]),
        (body(objective={"maximize": "forget_quality"}, retain_model=None), 422, ["forget_quality", "retain model"]),
        (body(forget=probes(0, 6, tofu=False)), 422, ["overall", "paraphrased_answer"]),
        (body(objective={"minimize": "mia_loss"}), 422, ["mia_loss", "holdout"]),
        (body(objective={"maximize": "forget_fluency"}), 422, ["forget_fluency", "fluency classifier"]),
        (body(retain_model="no/such-model"), 404, ["no/such-model"]),
        (body(objective=None), 422, ["constraints", "retain_model", "objective"]),
        (body(held_out_fraction=0.5, forget=probes(0, 1)), 422, ["held_out_fraction"]),
        (body(utility={"retain": probes(20, 22)}), 422, ["retain"]),
    ],
)
def test_an_objective_that_cannot_be_measured_is_refused_naming_it(
    api: httpx.Client, live_server: LiveServer, request_body: dict[str, Any], status: int, mentions: list[str]
) -> None:
    request_body = {k: v for k, v in request_body.items() if v is not None}
    with unchanged(live_server):
        assert_problem(api.post(f"/models/{MODEL}/calibrate", json=request_body), status, *mentions)


def test_a_calibration_maximising_overall_reports_its_metrics_and_checks_held_out_probes(api: httpx.Client) -> None:
    # the tiny model is untrained: its ROUGE is 0 and so its model_utility; the answer's probability is not
    floor = [{"metric": "retain_Q_A_Prob", "min_ratio_to_base": 0.5}]
    request = body(
        budget=7,
        held_out_fraction=0.34,
        utility={"world": probes(30, 36)},
        holdout=probes(36, 40, tofu=False),
        constraints=floor,
    )
    submitted = api.post(f"/models/{MODEL}/calibrate", json=request)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(api, submitted.json()["job"]["job_id"], timeout=600)
    assert job["status"] == "succeeded", job.get("error")
    result = job["result"]
    assert result["objective"] == {"metric": "overall", "sense": "maximize"}
    assert result["retain_model"] == MODEL
    base_prob = result["base_metrics"]["retain_Q_A_Prob"]
    [bound] = result["constraints"]
    assert bound["metric"] == "retain_Q_A_Prob" and bound["base"] == pytest.approx(base_prob)
    assert bound["min"] == pytest.approx(0.5 * base_prob)
    assert result["constraint"] == {"min_retain_Q_A_Prob": bound["min"]}  # the old field names the bound applied
    assert 1 <= result["evaluations"] <= 7
    for candidate in result["candidates"]:
        metrics = candidate["metrics"]
        assert {"overall", "model_utility", "privacy", "memorization", "forget_nll_ratio", "mia_loss"} <= set(metrics)
        assert "world_Truth_Ratio" in metrics  # the utility set is scored
        assert candidate["feasible"] == (metrics["retain_Q_A_Prob"] >= bound["min"])
        assert metrics["forget_nll_ratio"] == pytest.approx(candidate["forget"]["nll_ratio"], rel=1e-9)
    feasible = [c for c in result["candidates"] if c["feasible"]]
    assert feasible, result["note"]  # α_min = 0.05 barely changes the model: the floor holds there
    best = max(feasible, key=lambda c: (c["metrics"]["overall"], -c["options"]["alpha"]))
    recommended = result["recommended"]
    assert recommended["candidate"] == best["index"] and recommended["metrics"] == best["metrics"]
    assert api.get(f"/variants/{recommended['variant_id']}").json()["status"] == "ready"
    held = result["held_out"]
    # 6 forget, 8 retain, 6 world probes: round(0.34·n) of each held out
    assert held["probes"] == {"forget": 2, "retain": 3, "world": 2}
    assert held["constraints"][0]["base"] == pytest.approx(held["base"]["retain_Q_A_Prob"])
    assert held["feasible"] == (held["recommended"]["retain_Q_A_Prob"] >= held["constraints"][0]["min"])
    assert math.isfinite(held["recommended"]["overall"])

    png = api.get(result["front_png"], params={"x": "retain_Q_A_Prob", "y": "overall"})
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG\r\n\x1a\n")
    assert png.content != api.get(result["front_png"]).content
    assert_problem(api.get(result["front_png"], params={"x": "model_utility", "y": "nope"}), 422, "nope")
