"""The default calibration on a real pretrained LLM, judged on facts no search saw (issue 36's bar).

SmolLM2-135M-Instruct (``real_llm_dir``) knows capitals and chemical symbols. The data is laid out
as a platform that wants a measurable edit lays it out (docs/real-model.md, "Laying out the data"):

* facts the base model knows with confidence: its teacher-forced argmax is the answer, and it gives
  the answer's tokens at least even odds on average (:func:`bench.real_data.confidently_known`; a fact
  it answers by a hair flips under any change to the weights, and would measure that noise, not the
  edit);
* the concepts are sentences (text records: every token enters the statistics, the positions that
  predict the answer included): the target concept states 70% of the capitals, a reference concept
  45% of the symbols, and a reference of general English 150 paragraphs the model itself wrote
  (sampled at temperature 0.8 from everyday openers, seed fixed: the test's prose is the model's);
* the calibration's retain probes are symbols **no concept holds** (25% of them): the universe spares
  its own records by construction, so a retain floor measured on them says nothing about the rest
  (the result warns when retain probes are a reference's records);
* held out of every concept and of the search: 30% of the capitals, 30% of the symbols and 20
  paragraphs.

Through the live API (embedded mode): a calibrate request with no objective (the exact-match
default: the lowest forget exact match with retain exact match ≥ 0.9 × the base's and perplexity on
``utility.general`` ≤ ×1.10), forget probes the capitals in the concept, retain probes the symbols
outside it; then ``POST /variants/{id}/evaluate`` scores the recommendation on the held-out sets. The
issue's targets: held-out forget exact match ≤ 25%, held-out kept exact match ≥ 90%, perplexity on
held-out paragraphs ≤ ×1.10. The figures are printed (``-s``); the targets are asserted.

Measured on 2026-11-29 (this machine, 2 threads, 4 minutes in all): 24 capitals and 33 symbols
known with confidence; the recommendation α 0.219 on the MLP layers (searched: forget exact 0%,
kept 100%) answered 0 of 7 unseen capitals, kept 10 of 10 unseen symbols, perplexity ×1.035 on 20
unseen paragraphs. The same request on the earlier layout (prompt/completion records, retain probes
from the reference, every fact the argmax answers) kept 8 of 10: docs/real-model.md, "Laying out
the data". Run ``pytest -s tests/e2e/test_real_llm_calibration.py`` to see the figures.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bench.real_layout import layout_data, sentences
from engram_fixtures.live import LiveServer, wait_for_job
from tests.helpers.api import register_model

pytestmark = pytest.mark.slow

MODEL_ID = "real/smollm2"
TARGETS = {"forget": 0.25, "kept": 0.90, "perplexity": 1.10}
Record = dict[str, str]


@pytest.fixture(scope="module")
def data(real_llm_dir: Path) -> dict[str, list[Record]]:
    """:func:`bench.real_layout.layout_data`'s splits (the bench's layout tables are of this data)."""
    torch.set_num_threads(2)
    splits = layout_data(real_llm_dir, "confident")
    capitals = sum(len(splits[name]) for name in ("forget", "held_forget"))
    symbols = sum(len(splits[name]) for name in ("kept", "retain", "held_kept"))
    assert capitals >= 20 and symbols >= 28, (capitals, symbols)
    return splits


def post_concept(client: httpx.Client, name: str, role: str, records: list[dict[str, str]]) -> str:
    response = client.post("/concepts", json={"name": name, "role": role, "models": [MODEL_ID], "records": records})
    assert response.status_code == 202, response.text
    return str(response.json()["jobs"][0]["job_id"])


def evaluate(client: httpx.Client, variant_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(f"/variants/{variant_id}/evaluate", json=body)
    assert response.status_code in (200, 202), response.text
    job = response.json()  # the evaluation's job (200: finished within the request's wait)
    if job["status"] not in ("succeeded", "failed", "cancelled"):
        job = wait_for_job(client, job["job_id"], timeout=1800)
    assert job["status"] == "succeeded", job
    return dict(job["result"]["summary"])


def test_the_default_calibration_of_a_real_llm_forgets_held_out_capitals_and_keeps_the_rest(
    live_server: LiveServer, real_llm_dir: Path, data: dict[str, list[Record]]
) -> None:
    client = live_server.client
    started = time.monotonic()
    register_model(client, MODEL_ID, f"file://{real_llm_dir}", existing_ok=True, timeout=1800)
    jobs = [
        post_concept(client, "real-capitals", "target", sentences(data["forget"])),
        post_concept(client, "real-symbols", "reference", sentences(data["kept"])),
        post_concept(client, "real-prose", "reference", data["reference_text"]),
    ]
    for job_id in jobs:
        assert wait_for_job(client, job_id, timeout=1800)["status"] == "succeeded"
    body = {
        "concepts": ["real-capitals"],
        "forget": data["forget"],
        "retain": data["retain"],
        "utility": {"general": data["general"]},
        "module_sets": ["all", "mlp"],
        "scalings": ["uniform"],
        "alpha_min": 0.05,
        "alpha_max": 2.0,
        "budget": 16,
    }
    submitted = client.post(f"/models/{MODEL_ID}/calibrate", json=body)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(client, submitted.json()["job"]["job_id"], timeout=3600)
    assert job["status"] == "succeeded", job
    result = job["result"]
    rec = result["recommended"]
    print(f"\ncalibration result: {json.dumps({k: v for k, v in result.items() if k != 'candidates'})}")  # noqa: T201
    assert rec is not None, result["note"]
    assert "retain_probes_in_reference" not in result  # the retain probes are outside every concept
    facts = evaluate(client, rec["variant_id"], {"forget": data["held_forget"], "retain": data["held_kept"]})
    prose = evaluate(client, rec["variant_id"], {"retain": data["held_general"]})
    held_forget = facts["variant"]["forget"]["exact_match"]
    held_kept = facts["variant"]["retain"]["exact_match"]
    perplexity = math.exp(prose["variant"]["retain"]["mean_nll"] - prose["base"]["retain"]["mean_nll"])
    print(  # noqa: T201 - the figures, with -s
        f"\nreal LLM ({MODEL_ID}): recommended α={rec['options']['alpha']:.3g} {rec['options']['module_set']} "
        f"{rec['options']['scaling']}; searched: forget exact {rec['forget_exact_match']:.0%} "
        f"(base {result['base']['forget']['exact_match']:.0%}), kept exact {rec['retain_exact_match']:.0%}, "
        f"forget ×NLL {rec['forget_nll_ratio']:.3g}, retain ×NLL {rec['retain_nll_ratio']:.3g}; "
        f"held out by the calibration: margins {result['held_out']['margins']}; "
        f"never seen: capitals {len(data['held_forget'])} (base {facts['base']['forget']['exact_match']:.0%}) "
        f"answered {held_forget:.0%}, symbols {len(data['held_kept'])} (base {facts['base']['retain']['exact_match']:.0%}) "
        f"kept {held_kept:.0%}, perplexity on {len(data['held_general'])} paragraphs ×{perplexity:.3f}; "
        f"{result['evaluations']} candidates, search {result['seconds']['search']:.0f} s, "
        f"all {time.monotonic() - started:.0f} s; warnings {result['warnings']}"
    )
    assert held_forget <= TARGETS["forget"]
    assert held_kept >= TARGETS["kept"]
    assert perplexity <= TARGETS["perplexity"]
