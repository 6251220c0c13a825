"""POST /models/{id}/calibrate with attack constraints (issue 37, the gate), through an in-process server
on the mini-TOFU demo (a tiny Llama trained on 200 facts; hidden 256, so every row is whole Q4_1 blocks).

The exact-match default calibration of the 20 forget facts, half of the probes held out, is gated by
"forget exact match after a Q4_1 round trip <= 0.4" and "recovered fraction after relearning (4
AdamW steps) <= 0.5". The recommended variant is downloaded and attacked here without the service's
attack code (:mod:`tests.helpers.attacks`: the gguf package's round trip, a plain AdamW loop with the
same seed) on the held-out probes (the service's split rule, restated here: ``round(0.5·n)`` indices
drawn by ``random.Random(0)``); its scores must equal what the result reports for it (exact match
exactly, NLL within 1e-4 nats) and meet both bounds. A bound nothing can meet (the forget answers'
NLL after Q4_1 at most 0) recommends nothing, and the note names the bound.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.demo import read_probes
from engram_fixtures.live import download_variant, wait_concepts_ready, wait_for_job
from tests.helpers.api import assert_problem, register_model
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.attacks import fine_tuned, q4_round_trip, summary

MODEL = "gate/demo"
NLL_TOLERANCE = 1e-4
FRACTION = 0.5
Q4 = {"kind": "quantize", "type": "Q4_1"}
RELEARN = {"kind": "relearn", "steps": 4, "lr": 5e-4, "seed": 3}
# 0.4, not tighter: the demo's bytes depend on the CPU that trained it (docs/tutorial.md), and on an
# AVX-512 EPYC the strongest candidate the retain floor admits keeps 3 of the 10 held-out facts after
# Q4_1 (0.3), where another CPU's demo kept 2. The bound still removes most of what the base knows (1.0).
Q4_MAX = 0.4
GATE = [
    {"attack": Q4, "metric": "forget_exact_match", "max": Q4_MAX},
    {"attack": RELEARN, "metric": "recovered_fraction", "max": 0.5},
]


@pytest.fixture(scope="module")
def server(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    root = tmp_path_factory.mktemp("gate-models")
    shutil.copytree(mini_tofu_demo / "demo" / "model", root / "demo")
    with in_process_server(tmp_path_factory.mktemp("gate"), root) as app:
        yield app


@pytest.fixture(scope="module")
def facts(mini_tofu_demo: Path) -> dict[str, list[dict[str, str]]]:
    demo = mini_tofu_demo / "demo"
    forget = [{"prompt": p.prompt, "completion": p.completion} for p in read_probes(demo / "forget.jsonl")]
    retain = [{"prompt": p.prompt, "completion": p.completion} for p in read_probes(demo / "retain.jsonl")]
    return {"forget": forget, "retain": retain[:20], "reference": retain}


@pytest.fixture(scope="module")
def concepts(server: InProcessServer, facts: dict[str, list[dict[str, str]]]) -> None:
    api = server.client
    register_model(api, MODEL, f"file://{server.model_root / 'demo'}")
    for name, role, split in (("gate-forget", "target", "forget"), ("gate-retain", "reference", "reference")):
        response = api.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": facts[split]})
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["gate-forget", "gate-retain"], MODEL, timeout=600)


def _calibrate(server: InProcessServer, facts: dict[str, Any], gate: list[dict[str, Any]]) -> dict[str, Any]:
    body = {
        "concepts": ["gate-forget"],
        "forget": facts["forget"],
        "retain": facts["retain"],
        "min_retain_exact_match_ratio": 0.5,
        "module_sets": ["all"],
        "scalings": ["uniform"],
        "budget": 8,
        "alpha_min": 0.1,
        "alpha_max": 2.0,
        "held_out_fraction": FRACTION,
        "attack_constraints": gate,
    }
    response = server.client.post(f"/models/{MODEL}/calibrate", json=body)
    assert response.status_code in (200, 202), response.text
    job = wait_for_job(server.client, response.json()["job"]["job_id"], timeout=1200)
    assert job["status"] == "succeeded", job.get("error")
    return dict(job["result"])


def _evaluate(server: InProcessServer, variant_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = server.client.post(f"/variants/{variant_id}/evaluate", json=body)
    assert response.status_code in (200, 202), response.text
    job = wait_for_job(server.client, response.json()["job_id"], timeout=900)
    assert job["status"] == "succeeded", job.get("error")
    return dict(job["result"])


def _held_out(items: list[dict[str, str]]) -> list[dict[str, str]]:
    """The held-out probes, in their order: the service's rule (seed 0), restated."""
    n_out = min(max(1, round(FRACTION * len(items))), len(items) - 1)
    out = set(random.Random(0).sample(range(len(items)), n_out))
    return [p for i, p in enumerate(items) if i in out]


def test_the_recommended_variant_meets_the_attack_constraints_on_held_out_probes(
    server: InProcessServer, concepts: None, facts: dict[str, list[dict[str, str]]], tmp_path: Path
) -> None:
    result = _calibrate(server, facts, GATE)
    gate, rec = result["attack_gate"], result["recommended"]
    assert rec is not None, json.dumps({k: result.get(k) for k in ("note", "attack_gate", "candidates")}, indent=1)
    assert list(gate["attacks"]) == ["quantize:Q4_1", "relearn"]
    assert rec["candidate"] in gate["passed"]
    assert 1 <= len(gate["attacked"]) <= 4  # only what the held-out check could recommend
    rows = {row["index"]: row for row in result["candidates"]}
    assert all(("attacked" in row) == (i in gate["attacked"]) for i, row in rows.items())
    reported = rows[rec["candidate"]]["attacked"]

    torch.set_num_threads(1)  # as the job process (OMP_NUM_THREADS=1): the same float32 sums
    tokenizer = AutoTokenizer.from_pretrained(server.model_root / "demo")
    variant_view = server.client.get(f"/variants/{rec['variant_id']}").json()
    variant = AutoModelForCausalLM.from_pretrained(download_variant(server.client, variant_view, tmp_path / "v")).eval()
    base = AutoModelForCausalLM.from_pretrained(server.model_root / "demo").eval()
    forget, retain = _held_out(facts["forget"]), _held_out(facts["retain"])
    assert gate["probes"]["quantize:Q4_1"] == {"forget": len(forget), "retain": len(retain)}

    rounded = q4_round_trip(variant)
    for split, records in (("forget", forget), ("retain", retain)):
        expected = summary(rounded, tokenizer, records)
        assert reported["quantize:Q4_1"][f"{split}_exact_match"] == expected["exact_match"], (split, expected)
        assert abs(reported["quantize:Q4_1"][f"{split}_mean_nll"] - expected["mean_nll"]) <= NLL_TOLERANCE
    assert summary(rounded, tokenizer, forget)["exact_match"] <= Q4_MAX

    trained, scored = forget[: len(forget) // 2], forget[len(forget) // 2 :]  # relearn's default: half
    tuned = fine_tuned(variant, tokenizer, trained, steps=4, lr=5e-4, seed=3)
    after = summary(tuned, tokenizer, scored)["exact_match"]
    before, known = summary(variant, tokenizer, scored)["exact_match"], summary(base, tokenizer, scored)["exact_match"]
    assert known > before, "the recommended variant forgot none of the relearn-scored facts"
    recovered = (after - before) / (known - before)
    assert reported["relearn"]["recovered_fraction"] == pytest.approx(recovered, abs=1e-12)
    assert recovered <= 0.5
    assert reported["relearn"]["forget_exact_match"] == after

    # evaluate with the same attacks on the same held-out probes: the same numbers, and the evaluation
    # stores which attacks the variant passed (thresholds as the gate's bounds)
    attacks = [
        {**Q4, "thresholds": [{"metric": "forget_exact_match", "max": Q4_MAX}]},
        {
            **RELEARN,
            "thresholds": [{"metric": "recovered_fraction", "max": 0.5}, {"metric": "forget_exact_match", "max": 0.0}],
        },
    ]
    evaluation = _evaluate(server, rec["variant_id"], {"forget": forget, "retain": retain, "attacks": attacks})
    quantized, relearned = evaluation["attacks"]["quantize:Q4_1"], evaluation["attacks"]["relearn"]
    assert quantized["summary"]["variant"]["forget"]["exact_match"] == reported["quantize:Q4_1"]["forget_exact_match"]
    assert relearned["recovered_fraction"] == pytest.approx(recovered, abs=1e-12)
    assert quantized["passed"] is True
    assert quantized["margins"] == {
        "max_forget_exact_match": pytest.approx(Q4_MAX - reported["quantize:Q4_1"]["forget_exact_match"])
    }
    assert relearned["passed"] is (after == 0.0)  # the second threshold: no relearn-scored fact answered
    files = [p for p in (server.storage_dir / "evaluations").glob("*.json") if not p.name.endswith(".request.json")]
    stored = [json.loads(p.read_text())["attacks"] for p in files]
    assert {(a["quantize:Q4_1"]["passed"], a["relearn"]["passed"]) for a in stored} == {(True, relearned["passed"])}


def test_a_constraint_no_candidate_meets_recommends_nothing_and_names_it(
    server: InProcessServer, concepts: None, facts: dict[str, list[dict[str, str]]]
) -> None:
    impossible = [{"attack": Q4, "metric": "forget_mean_nll", "max": 0.0}]  # an answer NLL is never below 0
    result = _calibrate(server, facts, impossible)
    assert result["recommended"] is None
    note = result["note"]
    assert "attack constraints" in note and "quantize:Q4_1 forget_mean_nll" in note and "max 0" in note, note
    gate = result["attack_gate"]
    assert gate["passed"] == [] and 1 <= len(gate["attacked"]) <= 4
    assert "held_out" not in result  # nothing recommended: nothing checked for it


def test_attack_constraints_that_cannot_be_checked_are_refused(
    server: InProcessServer, concepts: None, facts: dict[str, list[dict[str, str]]]
) -> None:
    url = f"/models/{MODEL}/calibrate"
    base: dict[str, Any] = {"concepts": ["gate-forget"], "forget": facts["forget"], "retain": facts["retain"]}
    rephrase = {"attack": {"kind": "rephrase", "form": "no_template"}, "metric": "forget_exact_match", "max": 0.2}
    other_relearn = {"attack": {**RELEARN, "steps": 2}, "metric": "forget_exact_match", "max": 0.5}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"attack_constraints": [{"attack": Q4, "metric": "recovered_fraction", "max": 0.3}]}, "relearn's"),
        ({"attack_constraints": [rephrase]}, "rephrase"),
        ({"attack_constraints": [{"attack": Q4, "metric": "forget_exact_match"}]}, "no bound"),
        ({"max_retain_nll_ratio": 2.0, "attack_constraints": GATE[:1]}, "held_out_fraction"),
        ({"attack_constraints": [GATE[0], {**GATE[0], "max": 0.1}, other_relearn, GATE[1]]}, "two settings"),
        ({"held_out_fraction": 0.05, "attack_constraints": GATE[1:]}, "held-out forget probes"),
    ]
    for changes, mention in cases:
        assert_problem(server.client.post(url, json={**base, **changes}), 422, mention)
