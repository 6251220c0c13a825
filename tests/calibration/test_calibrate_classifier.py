"""POST /models/{id}/calibrate on an image classifier (issue 25), on the real app in this process.

A tiny random ``ResNetForImageClassification`` (engram_fixtures.vision, 10 classes) is registered with
a second one of another seed as its "retrained" model, and concepts of scikit-learn's digits are
collected (the digit 0, and the others as reference). A calibration on labelled image probes scores
each candidate with the classifier's metrics; what it reports for a candidate equals what ``evaluate``
reports for that candidate built as a variant (the recommended one, and another built by a plain
unlearn request with the candidate's options), on the same probes: an independent path (the
variant's checkpoint written, downloaded and loaded by the evaluation job, not the in-memory swap).
Refusals name the probe, the model's kind, or the metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engram_fixtures.live import wait_concepts_ready, wait_for_job, wait_variant_ready
from engram_fixtures.models import make_tiny_llama
from engram_fixtures.vision import make_tiny_resnet
from tests.helpers.api import assert_problem
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.images import digit_indices, digit_record

pytestmark = pytest.mark.fast

RESNET, RETRAINED, LLAMA = "cal/resnet", "cal/retrained", "cal/llama"
TOL = 1e-6
FORGET_DIGIT = 0
SETS = ("forget", "retain", "test")


FORGET = [digit_record(i) for i in digit_indices(FORGET_DIGIT, 600, 8)]
RETAIN = [digit_record(i) for i in digit_indices(None, 600, 16, exclude=FORGET_DIGIT)]
TEST = [digit_record(i) for i in digit_indices(None, 1200, 20)]
TEXT = {"prompt": "Q: the capital of France? A:", "completion": " Paris"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("calibrate-classifier")
    make_tiny_resnet(root / "models" / "resnet", num_labels=10, seed=0)
    make_tiny_resnet(root / "models" / "retrained", num_labels=10, seed=1)
    make_tiny_llama(root / "models" / "llama")
    with in_process_server(root / "app", root / "models") as app:
        for model_id, folder in ((RESNET, "resnet"), (RETRAINED, "retrained"), (LLAMA, "llama")):
            response = app.client.post(
                "/models", json={"model_id": model_id, "source": f"file://{root / 'models' / folder}"}
            )
            assert response.status_code in (201, 202), response.text
            if response.status_code == 202:
                assert wait_for_job(app.client, response.json()["job_id"], 300)["status"] == "succeeded"
        zeros = [digit_record(i) for i in digit_indices(FORGET_DIGIT, 0, 20)]
        others = [digit_record(i) for i in digit_indices(None, 0, 60, exclude=FORGET_DIGIT)]
        for name, role, records in (("zero", "target", zeros), ("others", "reference", others)):
            body = {"name": name, "role": role, "models": [RESNET], "records": records}
            assert app.client.post("/concepts", json=body).status_code == 202
        wait_concepts_ready(app.client, ["zero", "others"], RESNET, timeout=300)
        yield app


def _job(server: InProcessServer, response: Any) -> dict[str, Any]:
    assert response.status_code in (200, 202), response.text
    body = response.json()
    job = body.get("job", body)
    if job["status"] != "succeeded":
        job = wait_for_job(server.client, job["job_id"], 600)
    assert job["status"] == "succeeded", job.get("error")
    return dict(job)


def _evaluate(server: InProcessServer, variant_id: str) -> dict[str, Any]:
    body = {"forget": FORGET, "retain": RETAIN, "test": TEST, "retain_model": RETRAINED}
    job = _job(server, server.client.post(f"/variants/{variant_id}/evaluate", params={"wait": 30}, json=body))
    section: dict[str, Any] = job["result"]["classifier"]
    return section


def _evaluated_metrics(section: dict[str, Any], model: str = "variant") -> dict[str, float]:
    """evaluate's classifier section under the calibration's metric names."""
    sets = section["models"][model]["sets"]
    values = {f"{s}_accuracy": sets[s]["accuracy"] for s in SETS}
    values |= {f"{s}_label_nll": sets[s]["label_nll"] for s in SETS}
    if model == "variant":
        scores = section["scores"]
        values["tow"] = scores["tow"]
        values |= {f"cka_to_base_{s}": scores["cka_to_base"][s] for s in SETS}
        values |= {f"cka_to_retrained_{s}": scores["cka_to_retrained"][s] for s in SETS}
    return values


def _assert_equal(reported: dict[str, Any], expected: dict[str, float], what: str) -> None:
    for name, value in expected.items():
        got = reported[name]
        assert got is not None and abs(got - value) <= TOL * max(1.0, abs(value)), (what, name, got, value)


@pytest.fixture(scope="module")
def calibration(server: InProcessServer) -> dict[str, Any]:
    body = {
        "concepts": ["zero"],
        "forget": FORGET,
        "retain": RETAIN,
        "test": TEST,
        "retain_model": RETRAINED,
        "budget": 4,
        "module_sets": ["all"],
        "scalings": ["uniform"],
        "alpha_min": 0.25,
        "alpha_max": 4.0,
    }
    job = _job(server, server.client.post(f"/models/{RESNET}/calibrate", json=body))
    result: dict[str, Any] = job["result"]
    return result


def test_a_classifier_calibration_maximises_tow_given_a_retrained_model(calibration: dict[str, Any]) -> None:
    assert calibration["objective"] == {"metric": "tow", "sense": "maximize"}  # the default with a retain model
    assert calibration["constraints"] == [] and calibration["retain_model"] == RETRAINED
    assert calibration["evaluations"] == 4
    names = set(calibration["candidates"][0]["metrics"])
    assert {"forget_accuracy", "retain_accuracy", "test_accuracy", "tow", "cka_to_retrained_test"} <= names
    assert not names & {"forget_nll_ratio", "retain_nll_ratio"}  # text names are not shown for a classifier
    best = calibration["recommended"]
    tows = [c["metrics"]["tow"] for c in calibration["candidates"]]
    assert best is not None and best["metrics"]["tow"] == max(tows)
    # the candidate rows keep the text shape: label NLL, top-1 accuracy
    row = calibration["candidates"][best["candidate"]]
    assert row["forget"]["exact_match"] == best["metrics"]["forget_accuracy"]
    assert row["forget"]["mean_nll"] == pytest.approx(best["metrics"]["forget_label_nll"], abs=1e-12)


def test_the_reported_metrics_equal_evaluate_on_the_built_variants(
    server: InProcessServer, calibration: dict[str, Any]
) -> None:
    best = calibration["recommended"]
    section = _evaluate(server, best["variant_id"])
    _assert_equal(best["metrics"], _evaluated_metrics(section), "recommended")
    _assert_equal(calibration["base_metrics"], _evaluated_metrics(section, "base"), "base")
    # another candidate, built by an ordinary unlearn request with its options
    other = next(c for c in calibration["candidates"] if c["index"] != best["candidate"])
    options = other["options"]
    body = {
        "concepts": ["zero"],
        "alpha": options["alpha"],
        "scaling": options["scaling"],
        "universe": calibration["universe_id"],
        "format": "checkpoint",
    }
    response = server.client.post(f"/models/{RESNET}/unlearn", json=body)
    assert response.status_code in (200, 202), response.text
    variant = wait_variant_ready(server.client, response.json()["variant"]["variant_id"], timeout=300)
    _assert_equal(other["metrics"], _evaluated_metrics(_evaluate(server, variant["variant_id"])), "candidate")


def test_the_default_without_a_retrained_model_bounds_retain_accuracy(server: InProcessServer) -> None:
    body = {
        "concepts": ["zero"],
        "forget": FORGET,
        "retain": RETAIN,
        "budget": 3,  # every default arm (module sets and scalings) the coarse grid reaches first
        "held_out_fraction": 0.25,
    }
    result = _job(server, server.client.post(f"/models/{RESNET}/calibrate", json=body))["result"]
    assert result["objective"] == {"metric": "forget_accuracy", "sense": "minimize"}
    [bound] = result["constraints"]
    assert bound["metric"] == "retain_accuracy"
    assert bound["min"] == pytest.approx(0.9 * result["base_metrics"]["retain_accuracy"])
    for row in result["candidates"]:
        assert row["feasible"] == (row["metrics"]["retain_accuracy"] >= bound["min"])
    assert result["held_out"]["probes"] == {"forget": 2, "retain": 4}
    front = server.client.get(f"/calibrations/{result['calibration_id']}/front.png", params={"y": "tow"})
    assert_problem(front, 422, "tow")  # no retrained model: no ToW to draw
    drawn = server.client.get(f"/calibrations/{result['calibration_id']}/front.png", params={"x": "retain_label_nll"})
    assert drawn.status_code == 200 and drawn.content.startswith(b"\x89PNG")


IMAGE_BODY = {"concepts": ["zero"], "forget": FORGET[:2], "retain": RETAIN[:2]}


@pytest.mark.parametrize(
    ("model", "body", "mentions"),
    [
        (LLAMA, {"concepts": ["zero"], "forget": FORGET[:1], "retain": RETAIN[:1]}, ("forget[0] is an image probe", "text")),
        (RESNET, {"concepts": ["zero"], "forget": [TEXT], "retain": [TEXT]}, ("forget[0] is a text probe", "image model")),
        (RESNET, {**IMAGE_BODY, "retain": [TEXT]}, ("retain[0] is a text probe", "forget[0] is an image probe")),
        (RESNET, {**IMAGE_BODY, "objective": {"minimize": "forget_nll_ratio"}}, ("forget_nll_ratio", "text probes")),
        (RESNET, {**IMAGE_BODY, "objective": {"maximize": "overall"}}, ("overall", "text probes")),
        (RESNET, {**IMAGE_BODY, "objective": {"maximize": "tow"}}, ("tow", "retain_model", "test probes")),
        (RESNET, {**IMAGE_BODY, "retain_model": RETRAINED}, ("tow", "test probes")),
        (RESNET, {**IMAGE_BODY, "constraints": [{"metric": "test_accuracy", "min": 0.5}]}, ("test_accuracy", "test")),
        (RESNET, {**IMAGE_BODY, "max_retain_nll_ratio": 2.0}, ("max_retain_nll_ratio", "retain_accuracy")),
        (RESNET, {**IMAGE_BODY, "holdout": FORGET[:1]}, ("holdout", "text probes")),
        (RESNET, {**IMAGE_BODY, "retain_model": LLAMA, "test": TEST[:2]}, ("retain_model", "image")),
        (RESNET, {**IMAGE_BODY, "forget": [{**FORGET[0], "label": 12}]}, ("forget[0]", "12")),
        (
            LLAMA,
            {"concepts": ["zero"], "forget": [TEXT], "retain": [TEXT], "objective": {"maximize": "tow"}},
            ("tow", "image classifier"),
        ),
        (LLAMA, {"concepts": ["zero"], "forget": [TEXT], "retain": [TEXT], "test": [TEXT]}, ("test probes",)),
    ],
)
def test_a_request_of_the_wrong_kind_is_refused_by_name(
    server: InProcessServer, model: str, body: dict[str, Any], mentions: tuple[str, ...]
) -> None:
    assert_problem(server.client.post(f"/models/{model}/calibrate", json=body), 422, *mentions)
