"""A class-unlearning scenario through a live server's HTTP API, as the vision e2e modules run it
(tests/e2e/test_vision_api.py, test_classifier_evaluation_api.py, test_calibrate_classifier_api.py):
register an image classifier (tests.helpers.api.register_model), post one concept per class from
labelled image records, build their universe, unlearn a class and evaluate a variant. Every answer
is asserted on the way, so a module states only what it checks of the result.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from engram_fixtures.live import wait_concepts_ready, wait_for_job, wait_variant_ready

TIMEOUT_S = 900.0  # a job on a loaded machine (two shared cores): minutes, not seconds


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSONL image records of ``path`` (``{"image": <base64>, "label": <class>}``), blank lines skipped."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accepted(response: httpx.Response, statuses: Sequence[int] = (200, 201, 202)) -> dict[str, Any]:
    """The JSON body of an answer whose status is one of ``statuses``."""
    assert response.status_code in statuses, response.text
    body: dict[str, Any] = response.json()
    return body


def class_universe(
    client: httpx.Client, model_id: str, classes: Mapping[str, Sequence[dict[str, Any]]], timeout: float = TIMEOUT_S
) -> str:
    """One concept per class (name -> its records) collected on ``model_id``, and their universe built;
    returns its ID. A concept another run posted takes this model on (200)."""
    for name, records in classes.items():
        accepted(client.post("/concepts", json={"name": name, "models": [model_id], "records": list(records)}))
    wait_concepts_ready(client, list(classes), model_id, timeout=timeout)
    universe = accepted(client.post(f"/models/{model_id}/universes", json={"concepts": list(classes)}), (200, 202))
    if universe.get("job"):
        assert wait_for_job(client, universe["job"]["job_id"], timeout=timeout)["status"] == "succeeded"
    universe_id: str = universe["universe"]["universe_id"]
    return universe_id


def unlearn_class(
    client: httpx.Client, model_id: str, concept: str, universe_id: str, timeout: float = TIMEOUT_S, **options: Any
) -> dict[str, Any]:
    """The α=1 uniform unlearning of ``concept`` on ``universe_id`` (``options`` added to the body);
    the variant once ready (202 building, or 200: built by an earlier request)."""
    body = {"concepts": [concept], "alpha": 1.0, "scaling": "uniform", "universe": universe_id, **options}
    submitted = accepted(client.post(f"/models/{model_id}/unlearn", json=body), (200, 202))
    return wait_variant_ready(client, submitted["variant"]["variant_id"], timeout=timeout)


def evaluated(client: httpx.Client, variant_id: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """``POST /variants/{id}/evaluate`` (waiting up to a minute in the request, then on its job); the
    succeeded job."""
    job = accepted(client.post(f"/variants/{variant_id}/evaluate", params={"wait": 60}, json=body))
    if job["status"] != "succeeded":
        job = wait_for_job(client, job["job_id"], timeout=timeout)
    assert job["status"] == "succeeded", job
    return job


def classes_of(records: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The records by class: ``names[label]`` -> the records with that label, in their order."""
    by_class: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for record in records:
        by_class[names[int(record["label"])]].append(record)
    return by_class
