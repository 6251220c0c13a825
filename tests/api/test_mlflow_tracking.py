"""MLflow tracking (issue 39, platform hooks) against a real ``mlflow server`` with a sqlite backend.

A keyed service (ENGRAM_MLFLOW_TRACKING_URI set) builds a variant with labels and a reason and
evaluates it (with a quantization attack) through the HTTP API; its job process logs both runs.
What the tracking server then holds is read with ``MlflowClient``: params, tags and links equal the
request and the variant's URLs, the receipt artifact equals ``GET /variants/{id}/receipt`` as it was
before the evaluation, and every metric equals the stored evaluation's value exactly (JSON doubles
both ways: tolerance 0). Then the tracking server is stopped and a second variant is still built and
readable, its job's result saying in ``tracking`` why no run was logged (the WARNING a dead server
causes is checked in tests/jobs/test_tracking.py).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import wait_concepts_ready, wait_for_job, wait_variant_ready
from service.api.auth import key_identity
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer, another_client, in_process_server
from tests.helpers.mlflow import MlflowServer, mlflow_server

pytestmark = pytest.mark.slow  # collects and edits a tiny model, evaluates it with an attack

MODEL = "acme/tracked"
FACTS = make_facts(12, seed=5)
EXPERIMENT = "engram-tests"
PUBLIC_URL = "https://engram.example.test"
LABELS = {"ticket": "T-7", "team": "privacy"}
REASON = "erasure request 7"


@dataclass
class World:
    mlflow: MlflowServer
    server: InProcessServer
    write: httpx.Client
    write_key: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from engram_fixtures.models import make_tiny_llama

    root = tmp_path_factory.mktemp("tracking")
    model_dir = make_tiny_llama(root / "models" / "tiny-llama", hidden=32, layers=2, tie_word_embeddings=True)
    write_key = secrets.token_urlsafe(24)
    env = {
        "ENGRAM_API_KEYS": f"{write_key}:write",
        "ENGRAM_MLFLOW_EXPERIMENT": EXPERIMENT,
        "ENGRAM_MLFLOW_TIMEOUT_S": "3",
        "ENGRAM_PUBLIC_URL": PUBLIC_URL,
    }
    with mlflow_server(root / "mlflow") as mlflow:
        with in_process_server(root, root / "models", ENGRAM_MLFLOW_TRACKING_URI=mlflow.url, **env) as server:
            write = another_client(server, {"Authorization": f"Bearer {write_key}"})
            register_model(write, MODEL, f"file://{model_dir}")
            parts = (("tr-a", "target", FACTS[:4]), ("tr-b", "target", FACTS[4:8]), ("tr-ref", "reference", FACTS[8:]))
            for name, role, part in parts:
                records = [{"prompt": p, "completion": c} for p, c in part]
                body = {"name": name, "role": role, "models": [MODEL], "records": records}
                assert write.post("/concepts", json=body).status_code == 202
            wait_concepts_ready(write, ["tr-a", "tr-b", "tr-ref"], MODEL, timeout=600)
            yield World(mlflow, server, write, write_key)
            write.close()


def _unlearn(world: World, concept: str, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ready variant and its build job."""
    response = world.write.post(f"/models/{MODEL}/unlearn", json={"concepts": [concept], "alpha": 0.5, **extra})
    assert response.status_code in (200, 202), response.text
    variant_id = response.json()["variant"]["variant_id"]
    variant = wait_variant_ready(world.write, variant_id, timeout=600)
    job = wait_for_job(world.write, variant["job_id"], timeout=600)
    assert job["status"] == "succeeded", job
    return variant, job


@pytest.fixture(scope="module")
def tracked(world: World) -> dict[str, Any]:
    """The labelled variant, its receipt before evaluation, and its evaluation's job."""
    variant, job = _unlearn(world, "tr-a", labels=LABELS, reason=REASON)
    receipt = world.write.get(f"/variants/{variant['variant_id']}/receipt")
    assert receipt.status_code == 200, receipt.text
    probes = [{"prompt": p, "completion": c} for p, c in FACTS[:3]]
    body = {"forget": probes, "retain": probes, "attacks": [{"kind": "quantize", "type": "Q8_0"}]}
    response = world.write.post(f"/variants/{variant['variant_id']}/evaluate", json=body)
    assert response.status_code in (200, 202), response.text
    evaluation = wait_for_job(world.write, response.json()["job_id"], timeout=900)
    assert evaluation["status"] == "succeeded", evaluation
    return {"variant": variant, "job": job, "receipt": receipt.json(), "evaluation": evaluation}


def _client(world: World) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=world.mlflow.url)


def _artifact(client: Any, run_id: str, name: str, folder: Path) -> bytes:
    return Path(client.download_artifacts(run_id, name, str(folder))).read_bytes()


def test_a_built_variant_is_an_mlflow_run_with_its_request_links_and_receipt(
    world: World, tracked: dict[str, Any], tmp_path: Path
) -> None:
    variant, tracking = tracked["variant"], tracked["job"]["result"]["tracking"]
    assert tracking["logged"] is True, tracking
    assert tracking["url"] == f"{world.mlflow.url}/#/experiments/{tracking['experiment_id']}/runs/{tracking['run_id']}"
    client = _client(world)
    run = client.get_run(tracking["run_id"])
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == EXPERIMENT
    params, tags = run.data.params, run.data.tags
    assert params["model_id"] == MODEL and params["concepts"] == "tr-a"
    assert json.loads(params["terms"]) == variant["terms"] and list(variant["terms"]) == ["tr-a"]
    assert float(params["alpha"]) == 0.5
    assert params["reason"] == REASON
    assert params["created_by"] == key_identity(world.write_key)
    assert {k: params[f"label.{k}"] for k in LABELS} == LABELS
    assert params["option.scaling"] == variant["scaling"] and params["option.format"] == variant["format"]
    assert json.loads(params["option.modules"]) == variant["modules"]  # not a string: as JSON
    assert world.write_key not in json.dumps({**params, **tags})  # the fingerprint, never the key
    vid = variant["variant_id"]
    assert tags["engram.variant_id"] == vid and tags["engram.kind"] == "variant"
    assert tags["engram.variant_url"] == f"{PUBLIC_URL}/variants/{vid}"
    assert tags["engram.receipt_url"] == f"{PUBLIC_URL}/variants/{vid}/receipt"
    assert tags["engram.model_card_url"] == f"{PUBLIC_URL}/variants/{vid}/model-card"
    assert tags["label.ticket"] == "T-7"
    assert run.data.metrics["files_bytes"] == sum(f["size"] for f in variant["files"])
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["README.md", "receipt.json"]
    # The receipt as the service served it before the evaluation (the same stored state: the same bytes).
    assert json.loads(_artifact(client, run.info.run_id, "receipt.json", tmp_path)) == tracked["receipt"]
    assert tags["engram.receipt_digest"] == tracked["receipt"]["digest"]
    card = _artifact(client, run.info.run_id, "README.md", tmp_path).decode()
    assert f"# Variant {vid}" in card and tracked["receipt"]["digest"] in card


def test_an_evaluation_is_a_run_nested_under_its_variant_with_every_score(
    world: World, tracked: dict[str, Any], tmp_path: Path
) -> None:
    result = tracked["evaluation"]["result"]
    tracking = result["tracking"]
    assert tracking["logged"] is True, tracking
    variant_run = tracked["job"]["result"]["tracking"]["run_id"]
    assert tracking["parent_run_id"] == variant_run
    client = _client(world)
    run = client.get_run(tracking["run_id"])
    assert run.data.tags["mlflow.parentRunId"] == variant_run
    assert run.data.tags["engram.variant_id"] == tracked["variant"]["variant_id"]
    assert run.data.tags["engram.job_url"] == f"{PUBLIC_URL}/jobs/{tracked['evaluation']['job_id']}"
    metrics = run.data.metrics
    expected = {}
    for model, splits in result["summary"].items():
        for split, summary in splits.items():
            for name in ("mean_nll", "exact_match", "n"):
                expected[f"summary.{model}.{split}.{name}"] = summary[name]
    attack = result["attacks"]["quantize:Q8_0"]
    for model, splits in attack["summary"].items():
        for split, summary in splits.items():
            for name in ("mean_nll", "exact_match", "n"):
                expected[f"attacks.quantize_Q8_0.summary.{model}.{split}.{name}"] = summary[name]
    expected["attacks.quantize_Q8_0.seconds"] = attack["seconds"]
    assert len(expected) == 2 * 2 * 3 * 2 + 1  # base and variant, forget and retain, three figures; attacked too
    assert {name: metrics.get(name) for name in expected} == expected  # exact: JSON doubles both ways
    assert json.loads(run.data.params["attack.quantize_Q8_0"]) == attack["attack"]
    stored = json.loads(_artifact(client, run.info.run_id, "evaluation.json", tmp_path))
    # The evaluation as stored, records too: the job's result less what the runner and the tracker added.
    assert stored == {k: v for k, v in result.items() if k not in ("tracking", "worker")}
    assert len(stored["records"]) == 6
    runs = client.search_runs([run.info.experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted([variant_run, tracking["run_id"]])  # each logged once


def test_with_the_tracking_server_down_a_variant_is_still_built_and_says_why_it_was_not_logged(
    world: World, tracked: dict[str, Any]
) -> None:
    world.mlflow.stop()
    variant, job = _unlearn(world, "tr-b", labels={"ticket": "T-8"})
    tracking = job["result"]["tracking"]
    assert tracking["logged"] is False and tracking.get("run_id") is None
    assert f"'variant {variant['variant_id']}'" in tracking["warning"] and world.mlflow.url in tracking["warning"]
    assert "ENGRAM_MLFLOW_TRACKING_URI" in tracking["warning"]
    assert variant["status"] == "ready" and variant["files"]
    for entry in variant["files"]:  # whole and readable
        response = world.write.get(f"/variants/{variant['variant_id']}/files/{entry['path']}")
        assert response.status_code == 200 and len(response.content) == entry["size"]
    assert not (world.server.storage_dir / "variants" / variant["variant_id"] / "tracking.json").exists()
    # The first variant's record stays: a later evaluation of it would still be nested under its run.
    record = json.loads(
        (world.server.storage_dir / "variants" / tracked["variant"]["variant_id"] / "tracking.json").read_text()
    )
    assert record["run_id"] == tracked["job"]["result"]["tracking"]["run_id"]
    assert (record["tracking_uri"], record["experiment"]) == (world.mlflow.url, EXPERIMENT)
