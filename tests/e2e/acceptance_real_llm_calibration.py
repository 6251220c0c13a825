"""The default calibration on a real pretrained LLM, judged on facts it never saw (issue 36's bar).

SmolLM2-135M-Instruct (``real_llm_dir``) knows capitals and chemical symbols. Through the live API
(embedded mode): a target concept of capitals it answers ("The capital of France is" → " Paris"), a
reference concept of chemical symbols it answers, and a reference of general English: paragraphs
the model itself wrote (sampled at temperature 0.8 from everyday openers, seed fixed: the test data
is the model's own prose, so its perplexity is the model's). A calibrate request with no objective
(the exact-match default), forget probes from the capitals' concept, retain probes from the symbols'
and ``utility.general`` from the reference paragraphs, recommends a variant; then
``POST /variants/{id}/evaluate`` scores it on held-out capitals and symbols that no concept and no
search saw, and on held-out paragraphs. The issue's targets: held-out forget exact match ≤ 25%,
held-out kept exact match ≥ 90%, held-out perplexity ≤ ×1.10. The figures are printed; the targets
are asserted.

Not yet passing, so not collected by ``make test`` (its name is not ``test_*.py``): on 2026-11-29 the
recommendation (alpha 0.263, budget 10) answered 0% of unseen capitals and raised perplexity x1.047,
but kept 80% of unseen symbols against the 90% bar. With budget 16 (the same day) the search
converged on a gentler edit (alpha 0.199: searched forget exact 24%, kept 100%; unseen capitals
answered 9%, perplexity x1.031) that again kept 8 of the 10 unseen symbols: the two it loses are lost
at every alpha worth recommending, so a larger budget does not reach the bar; a larger or more
varied kept reference may. Issue 36 stays open on it: run it by name,
``pytest -s tests/e2e/acceptance_real_llm_calibration.py`` (a 135M model on the CPU: ~10 minutes),
and rename it ``test_real_llm_calibration.py`` once it passes.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import real_data
from engram_fixtures.live import LiveServer, wait_for_job
from tests.helpers.api import register_model

pytestmark = pytest.mark.slow

MODEL_ID = "real/smollm2"
# Capitals and chemical symbols SmolLM2-135M-Instruct answers exactly (teacher-forced argmax, checked
# again by the test on the base model: a fact it does not know is left out): the first 44 capitals and
# 23 symbols of the real-model bench's lists (bench/real_data.py, which extends these), and its openers.
CAPITALS = dict(list(real_data.CAPITALS.items())[:44])
SYMBOLS = dict(list(real_data.SYMBOLS.items())[:23])
OPENERS = list(real_data.OPENERS)
PER_OPENER = 5  # 100 paragraphs: 70 in the reference, 10 the calibration's general text, 20 held out
TARGETS = {"forget": 0.25, "kept": 0.90, "perplexity": 1.10}


def fact_probes(facts: dict[str, str], template: str) -> list[dict[str, str]]:
    return [{"prompt": template.format(key), "completion": f" {value}"} for key, value in facts.items()]


def known(model: Any, tokenizer: Any, probes: list[dict[str, str]]) -> list[dict[str, str]]:
    """The probes whose answer the base model's teacher-forced argmax reproduces."""
    kept = []
    for probe in probes:
        prompt = tokenizer(probe["prompt"])["input_ids"]
        answer = tokenizer(probe["prompt"] + probe["completion"])["input_ids"][len(prompt) :]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0]
        if logits[len(prompt) - 1 : -1].argmax(-1).tolist() == answer:
            kept.append(probe)
    return kept


def general_text(model: Any, tokenizer: Any) -> list[dict[str, str]]:
    """Paragraphs the model writes from everyday openers (as probes: the first word, then the rest)."""
    torch.manual_seed(0)
    tokenizer.padding_side = "left"
    batch = tokenizer([o for o in OPENERS for _ in range(PER_OPENER)], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=40, do_sample=True, temperature=0.8, top_p=0.95, pad_token_id=tokenizer.eos_token_id
        )
    texts = tokenizer.batch_decode(out, skip_special_tokens=True)
    paragraphs = []
    for text in texts:
        first, _, rest = " ".join(text.split()).partition(" ")
        paragraphs.append({"prompt": first, "completion": " " + rest})
    return random.Random(1).sample(paragraphs, len(paragraphs))


@pytest.fixture(scope="module")
def data(real_llm_dir: Path) -> dict[str, list[dict[str, str]]]:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(real_llm_dir)
    model = AutoModelForCausalLM.from_pretrained(real_llm_dir, torch_dtype=torch.float32).eval()
    capitals = known(model, tokenizer, fact_probes(CAPITALS, "The capital of {} is"))
    symbols = known(model, tokenizer, fact_probes(SYMBOLS, "The chemical symbol of {} is"))
    assert len(capitals) >= 30 and len(symbols) >= 18, (len(capitals), len(symbols))
    capitals, symbols = random.Random(2).sample(capitals, len(capitals)), random.Random(3).sample(symbols, len(symbols))
    general = general_text(model, tokenizer)
    n_forget, n_kept = round(0.7 * len(capitals)), round(0.55 * len(symbols))
    return {
        "forget": capitals[:n_forget],
        "held_forget": capitals[n_forget:],
        "kept": symbols[:n_kept],
        "held_kept": symbols[n_kept:],
        "reference_text": general[:70],
        "general": general[70:80],
        "held_general": general[80:],
    }


def post_concept(client: httpx.Client, name: str, role: str, records: list[dict[str, str]]) -> str:
    response = client.post("/concepts", json={"name": name, "role": role, "models": [MODEL_ID], "records": records})
    assert response.status_code == 202, response.text
    return str(response.json()["jobs"][0]["job_id"])


def evaluate(client: httpx.Client, variant_id: str, forget: list[Any], retain: list[Any]) -> dict[str, Any]:
    response = client.post(f"/variants/{variant_id}/evaluate", json={"forget": forget, "retain": retain})
    assert response.status_code in (200, 202), response.text
    job = response.json()  # the evaluation's job (200: finished within the request's wait)
    if job["status"] not in ("succeeded", "failed", "cancelled"):
        job = wait_for_job(client, job["job_id"], timeout=1800)
    assert job["status"] == "succeeded", job
    return dict(job["result"]["summary"])


def test_the_default_calibration_of_a_real_llm_forgets_held_out_capitals_and_keeps_the_rest(
    live_server: LiveServer, real_llm_dir: Path, data: dict[str, list[dict[str, str]]]
) -> None:
    client = live_server.client
    started = time.monotonic()
    register_model(client, MODEL_ID, f"file://{real_llm_dir}", existing_ok=True, timeout=1800)
    jobs = [
        post_concept(client, "real-capitals", "target", data["forget"]),
        post_concept(client, "real-symbols", "reference", data["kept"]),
        post_concept(client, "real-prose", "reference", data["reference_text"]),
    ]
    for job_id in jobs:
        assert wait_for_job(client, job_id, timeout=1800)["status"] == "succeeded"
    body = {
        "concepts": ["real-capitals"],
        "forget": data["forget"],
        "retain": data["kept"],
        "utility": {"general": data["general"]},
        "module_sets": ["all"],
        "scalings": ["uniform"],
        "alpha_min": 0.05,
        "alpha_max": 2.0,
        "budget": 10,
    }
    submitted = client.post(f"/models/{MODEL_ID}/calibrate", json=body)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(client, submitted.json()["job"]["job_id"], timeout=3600)
    assert job["status"] == "succeeded", job
    result = job["result"]
    rec = result["recommended"]
    print(f"\ncalibration result: {json.dumps({k: v for k, v in result.items() if k != 'candidates'})}")  # noqa: T201
    assert rec is not None, result["note"]
    facts = evaluate(client, rec["variant_id"], data["held_forget"], data["held_kept"])
    prose = evaluate(client, rec["variant_id"], data["held_general"], data["held_general"])
    held_forget = facts["variant"]["forget"]["exact_match"]
    held_kept = facts["variant"]["retain"]["exact_match"]
    perplexity = math.exp(prose["variant"]["forget"]["mean_nll"] - prose["base"]["forget"]["mean_nll"])
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
