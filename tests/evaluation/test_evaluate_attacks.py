"""POST /variants/{id}/evaluate with attacks (issue 37): per-attack scores through the HTTP API equal an
independent computation on the same probes.

On the mini-TOFU demo (a tiny Llama trained on 200 facts; hidden 256, so every row is whole Q4_1
blocks), a variant that forgets the 20 forget facts is evaluated with ``quantize`` (Q4_1),
``relearn`` (10 AdamW steps on the first 10 forget facts, scored on the other 10) and
``rephrase:paraphrased`` (TOFU's paraphrased answers). Each model's per-attack summary must equal what
:mod:`tests.helpers.attacks` computes here without the service's attack code: the gguf package's round
trip of the same tensors, a plain torch fine-tuning loop with the same seed, data and lr, and the
paraphrased probes scored as ordinary probes (exact match exactly, answer NLL within 1e-4 nats). Bad
attacks are 422 problems naming what is wrong, before any job.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.demo import make_facts, read_probes, tofu_answers
from engram_fixtures.live import download_variant, wait_concepts_ready, wait_for_job, wait_variant_ready
from service.engine.tofu_scoring import tofu_probe, tofu_statistics
from service.evaluation import tofu_metrics as tm
from tests.helpers.api import assert_problem, register_model
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.attacks import assert_summaries_equal, attack_table, fine_tuned, int8_linears, q4_round_trip, summary

MODEL = "attacks/demo"
NLL_TOLERANCE = 1e-4
RELEARN = {"kind": "relearn", "steps": 10, "lr": 5e-4, "seed": 3}
TRAINED = 10  # the default: the first half of the 20 forget probes


@pytest.fixture(scope="module")
def server(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    root = tmp_path_factory.mktemp("attack-models")
    shutil.copytree(mini_tofu_demo / "demo" / "model", root / "demo")
    with in_process_server(tmp_path_factory.mktemp("attacks"), root) as app:
        yield app


@pytest.fixture(scope="module")
def facts(mini_tofu_demo: Path) -> dict[str, list[dict[str, str]]]:
    demo = mini_tofu_demo / "demo"
    forget = [(p.prompt, p.completion) for p in read_probes(demo / "forget.jsonl")]
    retain = [(p.prompt, p.completion) for p in read_probes(demo / "retain.jsonl")][:20]
    paraphrases = [answer for answer, _ in tofu_answers(forget, seed=0)]
    return {
        "forget": [
            {"prompt": p, "completion": c, "paraphrased_answer": a} for (p, c), a in zip(forget, paraphrases, strict=True)
        ],
        "retain": [{"prompt": p, "completion": c} for p, c in retain],
    }


@pytest.fixture(scope="module")
def variant(server: InProcessServer, facts: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    api = server.client
    register_model(api, MODEL, f"file://{server.model_root / 'demo'}")
    plain = {s: [{"prompt": r["prompt"], "completion": r["completion"]} for r in facts[s]] for s in ("forget", "retain")}
    for name, role, split in (("atk-forget", "target", "forget"), ("atk-retain", "reference", "retain")):
        response = api.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": plain[split]})
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["atk-forget", "atk-retain"], MODEL, timeout=600)
    response = api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["atk-forget"], "alpha": 1.0})
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(api, response.json()["variant"]["variant_id"], timeout=600)


def _evaluate(server: InProcessServer, variant_id: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    response = server.client.post(f"/variants/{variant_id}/evaluate", json=body)
    assert response.status_code in (200, 202), response.text
    job = wait_for_job(server.client, response.json()["job_id"], timeout=900)
    assert job["status"] == "succeeded", job
    return str(job["job_id"]), dict(job["result"])


def test_quantize_relearn_and_rephrase_scores_equal_an_independent_computation(
    server: InProcessServer, variant: dict[str, Any], facts: dict[str, list[dict[str, str]]], tmp_path: Path
) -> None:
    attacks = [{"kind": "quantize", "type": "Q4_1"}, RELEARN, {"kind": "rephrase", "form": "paraphrased"}]
    body = {**facts, "attacks": attacks}
    job_id, result = _evaluate(server, variant["variant_id"], body)
    assert list(result["attacks"]) == ["quantize:Q4_1", "relearn", "rephrase:paraphrased"]

    torch.set_num_threads(1)  # as the job process (OMP_NUM_THREADS=1): the same float32 sums
    tokenizer = AutoTokenizer.from_pretrained(server.model_root / "demo")
    models = {
        "base": AutoModelForCausalLM.from_pretrained(server.model_root / "demo").eval(),
        "variant": AutoModelForCausalLM.from_pretrained(download_variant(server.client, variant, tmp_path / "v")).eval(),
    }
    forget, retain = facts["forget"], facts["retain"]
    held = forget[TRAINED:]
    paraphrased = [{"prompt": r["prompt"], "completion": r["paraphrased_answer"]} for r in forget]

    quantized = result["attacks"]["quantize:Q4_1"]
    # 4 layers x 6 linear weights and the untied embedding; down_proj's rows (688 values) are not whole
    # 32-value blocks (llama.cpp refuses them) and the head is Q6_K in llama.cpp: kept, and said
    for name in ("base", "variant"):
        kept = quantized["kept"][name]
        assert quantized["quantized"][name] == {"Q4_1": 4 * 6 + 1}
        assert sorted(kept) == sorted(["lm_head.weight"] + [f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)])
        assert "Q6_K" in kept["lm_head.weight"] and "688" in kept["model.layers.0.mlp.down_proj.weight"]
    relearn = result["attacks"]["relearn"]
    rephrased = result["attacks"]["rephrase:paraphrased"]
    assert relearn["attack"] == {**RELEARN}
    for name, model in models.items():
        rounded = q4_round_trip(model)
        for split, records in (("forget", forget), ("retain", retain)):
            expected = summary(rounded, tokenizer, records)
            assert_summaries_equal(quantized["summary"][name][split], expected, f"Q4_1 {name} {split}", NLL_TOLERANCE)
        tuned = fine_tuned(model, tokenizer, forget[:TRAINED], steps=10, lr=5e-4, seed=3)
        for split, records in (("forget", held), ("retain", retain)):
            expected = summary(tuned, tokenizer, records)
            assert_summaries_equal(relearn["summary"][name][split], expected, f"relearn {name} {split}", NLL_TOLERANCE)
            before = summary(model, tokenizer, records)
            assert_summaries_equal(relearn["unattacked"][name][split], before, f"unrelearned {name} {split}", NLL_TOLERANCE)
        for split, records in (("forget", paraphrased), ("retain", retain)):
            expected = summary(model, tokenizer, records)
            assert_summaries_equal(rephrased["summary"][name][split], expected, f"rephrase {name} {split}", NLL_TOLERANCE)

    base_em = relearn["unattacked"]["base"]["forget"]["exact_match"]
    variant_em = relearn["unattacked"]["variant"]["forget"]["exact_match"]
    attacked_em = relearn["summary"]["variant"]["forget"]["exact_match"]
    assert base_em > variant_em, relearn  # the edit forgot something, so the fraction is defined
    assert relearn["recovered_fraction"] == pytest.approx((attacked_em - variant_em) / (base_em - variant_em))
    _print_figures(result)

    again = server.client.post(f"/variants/{variant['variant_id']}/evaluate", json=body)  # the same evaluation
    assert again.status_code in (200, 202) and again.json()["job_id"] == job_id, again.text


def _print_figures(result: dict[str, Any]) -> None:
    print(attack_table(result))  # noqa: T201 (the figures the issue asks for, with -s)


@pytest.mark.parametrize(
    ("attack", "mentions"),
    [
        ({"kind": "quantize", "type": "Q6_K"}, ("Q8_0", "Q4_1", "nf4")),
        ({"kind": "relearn", "train_probes": 20}, ("relearn", "20 of 20", "train_probes")),
        ({"kind": "relearn", "train_probes": 2, "texts": ["some text"]}, ("train_probes or texts",)),
        ({"kind": "rephrase", "form": "no_template"}, ("rephrase:no_template", "no forget probe is a chat probe")),
        ({"kind": "rephrase", "form": "chat_template"}, ("rephrase:chat_template", "chat template")),
        ({"kind": "unlearn"}, ("quantize", "relearn", "rephrase")),
    ],
)
def test_an_attack_that_cannot_apply_is_refused_by_name_before_any_job(
    server: InProcessServer,
    variant: dict[str, Any],
    facts: dict[str, list[dict[str, str]]],
    attack: dict[str, Any],
    mentions: tuple[str, ...],
) -> None:
    jobs_before = sorted((server.storage_dir / "jobs").glob("*.json"))
    response = server.client.post(f"/variants/{variant['variant_id']}/evaluate", json={**facts, "attacks": [attack]})
    assert_problem(response, 422, *mentions)
    assert sorted((server.storage_dir / "jobs").glob("*.json")) == jobs_before


def test_the_same_attack_twice_and_paraphrases_that_are_missing_are_refused(
    server: InProcessServer, variant: dict[str, Any], facts: dict[str, list[dict[str, str]]]
) -> None:
    twice = {**facts, "attacks": [{"kind": "quantize", "type": "nf4"}, {"kind": "quantize", "type": "nf4"}]}
    assert_problem(
        server.client.post(f"/variants/{variant['variant_id']}/evaluate", json=twice), 422, "quantize:nf4", "twice"
    )
    bare = [{"prompt": r["prompt"], "completion": r["completion"]} for r in facts["forget"]]
    unparaphrased = {"forget": bare, "attacks": [{"kind": "rephrase", "form": "paraphrased"}]}
    response = server.client.post(f"/variants/{variant['variant_id']}/evaluate", json=unparaphrased)
    assert_problem(response, 422, "rephrase:paraphrased", "paraphrased_answer")


MIA = ["mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus"]


def test_membership_inference_aucs_after_an_attack_are_the_suites_on_the_attacked_models(
    server: InProcessServer, variant: dict[str, Any], facts: dict[str, list[dict[str, str]]], tmp_path: Path
) -> None:
    known = {w for r in facts["forget"] + facts["retain"] for w in (r["prompt"] + r["completion"]).split()}
    holdout = [{"prompt": p, "completion": c} for p, c in make_facts(40, seed=7919) if not set(c.split()) & known][:10]
    body = {**facts, "holdout": holdout, "metrics": MIA, "attacks": [{"kind": "quantize", "type": "int8"}]}
    _, result = _evaluate(server, variant["variant_id"], body)
    served = result["attacks"]["quantize:int8"]["tofu"]
    assert set(served) == {"base", "variant"}

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(server.model_root / "demo")
    folders = {"base": server.model_root / "demo", "variant": download_variant(server.client, variant, tmp_path / "v")}
    sets = {"forget": facts["forget"], "retain": facts["retain"], "holdout": holdout}
    for name, folder in folders.items():
        attacked = int8_linears(AutoModelForCausalLM.from_pretrained(folder).eval())
        stats = {
            s: tofu_statistics(attacked, tokenizer, [tofu_probe(dict(r)) for r in records], batch_size=16)
            for s, records in sets.items()
        }
        expected = tm.model_report(stats["forget"], stats["retain"], {}, stats["holdout"]).values
        assert set(served[name]["values"]) == set(MIA), served[name]
        for metric in MIA:
            assert served[name]["values"][metric] == pytest.approx(expected[metric], abs=1e-6), (name, metric)
    unattacked = result["tofu"]["variant"]["values"]
    print({m: (unattacked[m], served["variant"]["values"][m]) for m in MIA})  # noqa: T201 (MIA before/after int8)
