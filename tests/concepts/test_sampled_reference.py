"""A reference concept drawn from the model's own samples (``POST /concepts`` with ``samples``),
through the HTTP API of the real app on the tiny Llama.

The stored texts are checked against an independent draw in this test: the checkpoint loaded here
with transformers, ``torch.manual_seed(seed)``, then ``model.generate(..., do_sample=True)`` from BOS
in batches of the server's ENGRAM_COLLECT_BATCH_SIZE with the request's settings (the recipe
:mod:`service.concepts.sampled` states): equal text for text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.demo import make_facts
from engram_fixtures.live import wait_concepts_ready, wait_for_job, wait_variant_ready
from tests.helpers.api import assert_problem, register_model
from tests.helpers.app import InProcessServer

MODEL = "org/tiny-sampled"
OTHER = "org/tiny-sampled-b"
SAMPLES = {"count": 6, "max_new_tokens": 12, "temperature": 1.0, "seed": 0}


def post_samples(server: InProcessServer, name: str, samples: dict[str, Any], models: list[str] | None = None) -> Any:
    body = {"name": name, "models": models or [MODEL], "samples": samples}
    return server.client.post("/concepts", json=body)


def stored_texts(server: InProcessServer, concept: dict[str, Any]) -> list[str]:
    """The concept's stored records, read from the server's storage as its collection reads them."""
    path = server.storage_dir / "datasets" / f"{concept['dataset_digest']}.jsonl"
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def independent_draw(folder: Path, samples: dict[str, Any], batch_size: int) -> list[str]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts: list[str] = []
    torch.manual_seed(samples["seed"])
    with torch.inference_mode():
        for begin in range(0, samples["count"], batch_size):
            ids = torch.full((min(batch_size, samples["count"] - begin), 1), tokenizer.bos_token_id)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=samples["temperature"],
                top_k=0,
                top_p=1.0,
                max_new_tokens=samples["max_new_tokens"],
                min_new_tokens=samples["max_new_tokens"],
                pad_token_id=tokenizer.pad_token_id,
            )
            texts += tokenizer.batch_decode(out[:, 1:], skip_special_tokens=True)
    return texts


@pytest.fixture(scope="module")
def sampled(app_server: InProcessServer, tiny_llama_dir: Path) -> dict[str, Any]:
    """Concept ``self-0`` (seed 0) ready on ``org/tiny-sampled``; its first 202 body."""
    for model_id in (MODEL, OTHER):
        register_model(app_server.client, model_id, f"file://{tiny_llama_dir}", existing_ok=True)
    response = post_samples(app_server, "self-0", SAMPLES)
    assert response.status_code == 202, response.text
    wait_concepts_ready(app_server.client, ["self-0"], MODEL)
    return dict(response.json())


def test_samples_become_a_ready_reference_of_count_texts_equal_to_an_independent_draw(
    app_server: InProcessServer, tiny_llama_dir: Path, sampled: dict[str, Any]
) -> None:
    assert sampled["concept"]["role"] == "reference"  # the default of a drawn corpus
    concept = app_server.client.get("/concepts/self-0").json()
    assert concept["models"][MODEL]["status"] == "ready", concept
    assert concept["num_records"] == SAMPLES["count"]
    assert concept["samples"] == SAMPLES
    job = wait_for_job(app_server.client, sampled["jobs"][0]["job_id"])
    assert job["status"] == "succeeded", job
    texts = stored_texts(app_server, concept)
    assert len(texts) == SAMPLES["count"] and all(t.strip() for t in texts), texts
    expected = independent_draw(tiny_llama_dir, SAMPLES, app_server.settings.collect_batch_size)
    assert texts == expected


def test_the_same_samples_again_are_answered_from_storage(app_server: InProcessServer, sampled: dict[str, Any]) -> None:
    again = post_samples(app_server, "self-0", SAMPLES)
    assert again.status_code == 202, again.text
    assert [j["job_id"] for j in again.json()["jobs"]] == [j["job_id"] for j in sampled["jobs"]]  # no new job
    # Another concept with the same samples draws the same texts: the same dataset, its statistics reused.
    twin = post_samples(app_server, "self-0-twin", SAMPLES)
    assert twin.status_code == 202, twin.text
    shown = wait_concepts_ready(app_server.client, ["self-0-twin"], MODEL)["self-0-twin"]
    assert shown["dataset_digest"] == sampled_digest(app_server)
    job = wait_for_job(app_server.client, twin.json()["jobs"][0]["job_id"])
    assert job["status"] == "succeeded" and job["result"]["reused"] is True, job


def sampled_digest(server: InProcessServer) -> str:
    return str(server.client.get("/concepts/self-0").json()["dataset_digest"])


def test_another_seed_draws_other_texts(app_server: InProcessServer, sampled: dict[str, Any]) -> None:
    response = post_samples(app_server, "self-1", {**SAMPLES, "seed": 1})
    assert response.status_code == 202, response.text
    other = wait_concepts_ready(app_server.client, ["self-1"], MODEL)["self-1"]
    first = app_server.client.get("/concepts/self-0").json()
    assert other["dataset_digest"] != first["dataset_digest"]
    assert stored_texts(app_server, other) != stored_texts(app_server, first)
    assert len(stored_texts(app_server, other)) == SAMPLES["count"]


def test_an_unlearn_with_the_samples_as_reference_builds_a_variant(
    app_server: InProcessServer, sampled: dict[str, Any]
) -> None:
    records = [{"prompt": p, "completion": c} for p, c in make_facts(8, seed=3)[:4]]
    response = app_server.client.post("/concepts", json={"name": "sampled-forget", "models": [MODEL], "records": records})
    assert response.status_code == 202, response.text
    wait_concepts_ready(app_server.client, ["sampled-forget"], MODEL)
    body = {"concepts": ["sampled-forget"], "alpha": 1.0, "reference": ["sampled-forget", "self-0"]}
    answer = app_server.client.post(f"/models/{MODEL}/unlearn", json=body)
    assert answer.status_code in (200, 202), answer.text
    wait_variant_ready(app_server.client, answer.json()["variant"]["variant_id"])


@pytest.mark.parametrize(
    ("body", "status", "mentions"),
    [
        ({"models": [MODEL, OTHER], "samples": SAMPLES}, 422, ["one model", OTHER]),
        ({"models": [MODEL], "samples": {**SAMPLES, "max_new_tokens": 128}}, 422, ["at most 127"]),
        ({"models": [MODEL], "samples": SAMPLES, "records": [{"text": "a"}]}, 422, ["exactly one"]),
        ({"models": [MODEL], "samples": {**SAMPLES, "count": 0}}, 422, ["count"]),
        ({"models": [MODEL], "samples": {**SAMPLES, "count": 5_001}}, 422, ["ENGRAM_MAX_SAMPLES (5000)", "5001"]),
    ],
)
def test_bad_samples_are_refused_by_name(
    app_server: InProcessServer, sampled: dict[str, Any], body: dict[str, Any], status: int, mentions: list[str]
) -> None:
    before = app_server.client.get("/concepts").json()
    answer = app_server.client.post("/concepts", json={"name": "self-bad", **body})
    problem = assert_problem(answer, status)
    text = json.dumps(problem)
    assert all(m in text for m in mentions), problem
    assert app_server.client.get("/concepts").json() == before


def test_a_samples_concept_stays_with_the_model_that_drew_it(app_server: InProcessServer, sampled: dict[str, Any]) -> None:
    answer = post_samples(app_server, "self-0", SAMPLES, models=[OTHER])
    assert_problem(answer, 409, "drawn by model org/tiny-sampled", OTHER)
