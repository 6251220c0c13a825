"""Issue 37's done-when on the real model: through the HTTP API, an evaluation of SmolLM2-135M-Instruct's
variant with ``quantize`` (Q4_1) and ``relearn`` attacks answers per-attack scores equal to an
independent computation (:mod:`tests.helpers.attacks`: the gguf package's round trip of the same
tensors, a plain torch fine-tuning loop with the same seed, data and lr) on the same probes; the chat
template rephrasing is scored too. The figures are printed (run with ``-s``): forget exact match
before and after each attack, kept exact match, the kept facts' perplexity.

The forget kind: capitals the model knows; the kept kind: chemical symbols and other facts. The edit
is the issue's ``alpha 0.25`` on the capitals against the kept facts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.live import download_variant, wait_concepts_ready, wait_for_job, wait_variant_ready
from service.engine.evaluate import TextProbe, answer_nll, greedy_exact_match, summarize
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.attacks import JOB_BATCH, assert_summaries_equal, attack_table, fine_tuned, q4_round_trip, summary

pytestmark = pytest.mark.slow

MODEL = "attacks/smollm2"
NLL_TOLERANCE = 1e-4
CAPITALS = [
    (country, city)
    for country, city in (
        ("France", "Paris"), ("Japan", "Tokyo"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
        ("Russia", "Moscow"), ("Egypt", "Cairo"), ("England", "London"), ("Greece", "Athens"), ("China", "Beijing"),
    )
]  # fmt: skip
FORGET = [{"prompt": f"The capital of {country} is", "completion": f" {city}"} for country, city in CAPITALS]
KEPT = [
    {"prompt": "The chemical symbol for gold is", "completion": " Au"},
    {"prompt": "The chemical symbol for silver is", "completion": " Ag"},
    {"prompt": "The chemical symbol for iron is", "completion": " Fe"},
    {"prompt": "The chemical symbol for sodium is", "completion": " Na"},
    {"prompt": "The first man to walk on the moon was", "completion": " Neil Armstrong"},
    {"prompt": "Water is made of hydrogen and", "completion": " oxygen"},
]
RELEARN = {"kind": "relearn", "steps": 10, "lr": 2e-5, "seed": 0}


@pytest.fixture(scope="module")
def server(real_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path_factory.mktemp("real-attacks"), real_llm_dir.parent) as app:
        yield app


@pytest.fixture(scope="module")
def variant(server: InProcessServer, real_llm_dir: Path) -> dict[str, Any]:
    api = server.client
    register_model(api, MODEL, f"file://{real_llm_dir}")
    for name, role, records in (("real-capitals", "target", FORGET), ("real-kept", "reference", KEPT)):
        response = api.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": records})
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["real-capitals", "real-kept"], MODEL, timeout=900)
    body = {"concepts": ["real-capitals"], "reference": ["real-capitals", "real-kept"], "alpha": 0.25}
    response = api.post(f"/models/{MODEL}/unlearn", json=body)
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(api, response.json()["variant"]["variant_id"], timeout=900)


def _chat_summary(model: Any, tokenizer: Any, records: list[dict[str, str]]) -> dict[str, float]:
    probes = [
        TextProbe(
            messages=[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"].strip()}]
        )
        for r in records
    ]
    nll = answer_nll(model, tokenizer, probes, batch_size=JOB_BATCH)
    em = greedy_exact_match(model, tokenizer, probes, batch_size=JOB_BATCH)
    values = summarize(nll, em)
    return {"mean_nll": values["mean_nll"], "exact_match": values["exact_match"], "n": values["n"]}


def test_q4_1_and_relearn_on_the_real_models_variant_equal_an_independent_computation(
    server: InProcessServer, variant: dict[str, Any], real_llm_dir: Path, tmp_path: Path
) -> None:
    attacks = [{"kind": "quantize", "type": "Q4_1"}, RELEARN, {"kind": "rephrase", "form": "chat_template"}]
    started = time.monotonic()
    response = server.client.post(
        f"/variants/{variant['variant_id']}/evaluate", json={"forget": FORGET, "retain": KEPT, "attacks": attacks}
    )
    assert response.status_code in (200, 202), response.text
    job = wait_for_job(server.client, response.json()["job_id"], timeout=1800)
    assert job["status"] == "succeeded", job
    result = job["result"]
    seconds = time.monotonic() - started

    torch.set_num_threads(1)  # as the job process (OMP_NUM_THREADS=1)
    tokenizer = AutoTokenizer.from_pretrained(real_llm_dir)
    models = {
        "base": AutoModelForCausalLM.from_pretrained(real_llm_dir).eval(),
        "variant": AutoModelForCausalLM.from_pretrained(download_variant(server.client, variant, tmp_path / "v")).eval(),
    }
    quantized, relearn = result["attacks"]["quantize:Q4_1"], result["attacks"]["relearn"]
    # every decoder weight; the base's tied embedding/head is Q6_K in llama.cpp (kept). A variant saved
    # untied has its own head (kept) and embedding (Q4_1), as llama.cpp would write it.
    assert quantized["quantized"]["base"] == {"Q4_1": 30 * 7}
    assert list(quantized["kept"]["base"]) == ["model.embed_tokens.weight"], quantized["kept"]
    untied = not models["variant"].config.tie_word_embeddings
    assert quantized["quantized"]["variant"] == {"Q4_1": 30 * 7 + untied}, quantized
    assert list(quantized["kept"]["variant"]) == ["lm_head.weight" if untied else "model.embed_tokens.weight"]
    trained, held = FORGET[:5], FORGET[5:]
    for name, model in models.items():
        rounded = q4_round_trip(model)
        for split, records in (("forget", FORGET), ("retain", KEPT)):
            expected = summary(rounded, tokenizer, records)
            assert_summaries_equal(quantized["summary"][name][split], expected, f"Q4_1 {name} {split}", NLL_TOLERANCE)
        del rounded
        tuned = fine_tuned(model, tokenizer, trained, steps=RELEARN["steps"], lr=RELEARN["lr"], seed=RELEARN["seed"])
        for split, records in (("forget", held), ("retain", KEPT)):
            expected = summary(tuned, tokenizer, records)
            assert_summaries_equal(relearn["summary"][name][split], expected, f"relearn {name} {split}", NLL_TOLERANCE)
        del tuned
        chat = result["attacks"]["rephrase:chat_template"]["summary"][name]
        for split, records in (("forget", FORGET), ("retain", KEPT)):
            assert_summaries_equal(chat[split], _chat_summary(model, tokenizer, records), f"chat {name} {split}", 1e-4)
    print(f"\nSmolLM2-135M-Instruct, alpha 0.25 on {len(FORGET)} capitals; evaluation job {seconds:.0f} s")  # noqa: T201
    print(attack_table(result))  # noqa: T201
    print({name: report["seconds"] for name, report in result["attacks"].items()})  # noqa: T201
