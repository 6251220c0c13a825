"""POST /variants/{id}/evaluate with ``metrics``: TOFU's suite through the live server, against direct computation.

On the mini-TOFU demo (the session's ``mini_tofu_demo``: a tiny Llama trained on 200 facts), a
variant that forgets the forget facts is evaluated with ``"metrics": "tofu"`` against a retain model;
the job's every value (base, variant, retain) must equal :mod:`service.engine.tofu_scoring` +
:mod:`service.evaluation.tofu_metrics` run in this process on the downloaded artifact and the same
probes (1e-6), with the same ``left_out``. The retain model here is a second registered model: the
demo's weights with seeded noise (same tokenizer). It is not trained without the forget set (that
takes as long as the demo itself); what is tested is that the job scores whatever model it is given,
exactly as the library does. Bad requests are 4xx problems naming what is wrong, and the metrics
are part of the evaluation's stored identity.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from api_schemas import EvaluationResult
from engram_client.cli.output import stdout
from engram_client.cli.render import render_evaluation
from engram_fixtures.demo import make_facts, read_probes, tofu_answers
from engram_fixtures.live import (
    LiveServer,
    download_variant,
    start_server,
    stop_server,
    wait_concepts_ready,
    wait_for_job,
    wait_variant_ready,
)
from engram_fixtures.models import CHAT_TEMPLATE, make_tiny_chat_llama, make_tiny_llama
from service.engine.tofu_scoring import TofuProbe, tofu_probe, tofu_statistics
from service.evaluation import tofu_metrics as tm
from tests.helpers.api import assert_problem, register_model

BASE, RETAIN, OTHER = "tofu-eval/base", "tofu-eval/retain", "tofu-eval/other-vocab"
TOLERANCE = 1e-6
JOB_BATCH = 16  # the job's batch size (service.evaluation.run._CHUNK): padding changes float32 sums
N_RETAIN = 40  # retain probes scored (of 180): the job's cost, not the test's subject


@pytest.fixture(scope="module")
def server(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server whose model root holds the demo model, a noisy copy of it (the retain model) and a
    tiny Llama with another tokenizer."""
    work = tmp_path_factory.mktemp("tofu-eval")
    root = work / "models"
    shutil.copytree(mini_tofu_demo / "demo" / "model", root / "base")
    torch.manual_seed(0)
    noisy = AutoModelForCausalLM.from_pretrained(root / "base")
    with torch.no_grad():
        for parameter in noisy.parameters():
            parameter.add_(0.05 * parameter.std() * torch.randn_like(parameter))
    noisy.save_pretrained(root / "retain")
    AutoTokenizer.from_pretrained(root / "base").save_pretrained(root / "retain")
    make_tiny_llama(root / "other", hidden=32, layers=2)
    # One thread here and there, and the job's batches (16): the same float32 sums on both sides.
    live = start_server(work / "store", root, work / "server.log", OMP_NUM_THREADS="1")
    try:
        yield live
    finally:
        stop_server(live)


def _records(facts: list[tuple[str, str]], extra: dict[tuple[str, str], Any]) -> list[dict[str, Any]]:
    return [
        {"prompt": p, "completion": c, "paraphrased_answer": extra[(p, c)][0], "perturbed_answers": list(extra[(p, c)][1])}
        for p, c in facts
    ]


@pytest.fixture(scope="module")
def probes(mini_tofu_demo: Path) -> dict[str, Any]:
    """The demo's forget and (some) retain facts with TOFU's answers, fresh holdout facts, a utility set."""
    demo = mini_tofu_demo / "demo"
    sets = {
        split: [(p.prompt, p.completion) for p in read_probes(demo / f"{split}.jsonl")] for split in ("forget", "retain")
    }
    everything = sets["forget"] + sets["retain"]
    extra = dict(zip(everything, tofu_answers(everything, seed=0), strict=True))
    known = {w for p, c in everything for w in (p + c).split()}
    fresh = [(p, c) for p, c in make_facts(40, seed=7919) if not set(c.split()) & known][:10]
    return {
        "forget": _records(sets["forget"], extra),
        "retain": _records(sets["retain"][:N_RETAIN], extra),
        "holdout": [{"prompt": p, "completion": c} for p, c in fresh],
        "utility": {"authors": _records(sets["retain"][N_RETAIN : N_RETAIN + 15], extra)},
    }


@pytest.fixture(scope="module")
def variant(server: LiveServer, probes: dict[str, Any]) -> dict[str, Any]:
    api = server.client
    for model_id, folder in ((BASE, "base"), (RETAIN, "retain"), (OTHER, "other")):
        register_model(api, model_id, f"file://{server.model_root / folder}")
    plain = {s: [{"prompt": r["prompt"], "completion": r["completion"]} for r in probes[s]] for s in ("forget", "retain")}
    for name, role, split in (("tofu-eval-forget", "target", "forget"), ("tofu-eval-retain", "reference", "retain")):
        body = {"name": name, "role": role, "models": [BASE], "records": plain[split]}
        assert api.post("/concepts", json=body).status_code == 202
    wait_concepts_ready(api, ["tofu-eval-forget", "tofu-eval-retain"], BASE, timeout=600)
    response = api.post(f"/models/{BASE}/unlearn", json={"concepts": ["tofu-eval-forget"], "alpha": 1.0})
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(api, response.json()["variant"]["variant_id"], timeout=600)


def _post(api: httpx.Client, variant_id: str, body: dict[str, Any]) -> httpx.Response:
    return api.post(f"/variants/{variant_id}/evaluate", json=body)


def _evaluate_job(api: httpx.Client, variant_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = _post(api, variant_id, body)
    assert response.status_code in (200, 202), response.text
    job = wait_for_job(api, response.json()["job_id"], timeout=600)
    assert job["kind"] == "evaluate" and job["status"] == "succeeded", job
    return dict(job)


def _evaluate(api: httpx.Client, variant_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return dict(_evaluate_job(api, variant_id, body)["result"])


def _tofu_body(probes: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {**probes, "metrics": "tofu", "retain_model": RETAIN, **options}


@pytest.fixture(scope="module")
def tofu_job(server: LiveServer, variant: dict[str, Any], probes: dict[str, Any]) -> dict[str, Any]:
    return _evaluate(server.client, variant["variant_id"], _tofu_body(probes))


def _direct(models: dict[str, Path], probes: dict[str, Any]) -> dict[str, tm.ModelReport]:
    """The suite computed here, on the downloaded/registered files, with the library's own functions."""
    tokenizer = AutoTokenizer.from_pretrained(models["base"])
    sets: dict[str, list[TofuProbe]] = {
        "forget": [tofu_probe(r) for r in probes["forget"]],
        "retain": [tofu_probe(r) for r in probes["retain"]],
        "holdout": [tofu_probe(r) for r in probes["holdout"]],
        "authors": [tofu_probe(r) for r in probes["utility"]["authors"]],
    }
    raw = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, folder in models.items():
            model = AutoModelForCausalLM.from_pretrained(folder).eval()
            stats = {s: tofu_statistics(model, tokenizer, items, batch_size=JOB_BATCH) for s, items in sets.items()}
            raw[name] = tm.model_report(stats["forget"], stats["retain"], {"authors": stats["authors"]}, stats["holdout"])
    finally:
        torch.set_num_threads(threads)
    return {name: tm.tofu_scores(report, raw["retain"], raw["base"]) for name, report in raw.items()}


@pytest.mark.slow
def test_tofu_suite_equals_direct_computation(
    server: LiveServer, variant: dict[str, Any], probes: dict[str, Any], tofu_job: dict[str, Any], tmp_path: Path
) -> None:
    models = {
        "base": server.model_root / "base",
        "variant": download_variant(server.client, variant, tmp_path / "variant"),
        "retain": server.model_root / "retain",
    }
    expected = _direct(models, probes)
    assert tofu_job["retain_model"] == RETAIN
    assert set(tofu_job["tofu"]) == {"base", "variant", "retain"}
    for name, report in expected.items():
        served = tofu_job["tofu"][name]
        assert served["left_out"] == report.left_out, name
        assert set(served["values"]) == set(report.values), name
        for metric, value in report.values.items():
            got = served["values"][metric]
            if not math.isfinite(value):  # log10 of a p-value of 0 travels as null
                assert got is None, (name, metric)
            else:
                assert got == pytest.approx(value, abs=TOLERANCE, rel=TOLERANCE), (name, metric)
    # every aggregate is there (the suite had every field it needs), and the edit moved memorization
    for name in ("base", "variant", "retain"):
        assert {"memorization", "utility", "privacy", "overall", "forget_quality"} <= set(tofu_job["tofu"][name]["values"])
    variant_values, base_values = tofu_job["tofu"]["variant"]["values"], tofu_job["tofu"]["base"]["values"]
    assert variant_values["exact_memorization"] < base_values["exact_memorization"]


@pytest.mark.slow
def test_summary_and_records_are_as_without_metrics(
    server: LiveServer, variant: dict[str, Any], probes: dict[str, Any], tofu_job: dict[str, Any]
) -> None:
    """The same probes without metrics: another evaluation (not the stored TOFU one), with the same
    NLL/exact-match fields and no ``tofu``; asking for a list of metrics is a third one, holding those."""
    plain = {s: probes[s] for s in ("forget", "retain")}
    without = _evaluate(server.client, variant["variant_id"], plain)
    assert not without.get("reused") and without.get("tofu") is None
    assert without["summary"] == tofu_job["summary"] and without["records"] == tofu_job["records"]
    again = _evaluate(server.client, variant["variant_id"], _tofu_body(probes))
    assert again == tofu_job, "issue 35, finding 9: answered by the job that stored the result"
    some = _evaluate(server.client, variant["variant_id"], _tofu_body(probes, metrics=["exact_memorization", "overall"]))
    assert not some.get("reused")
    for name in ("base", "variant", "retain"):
        assert some["tofu"][name]["values"] == {
            k: tofu_job["tofu"][name]["values"][k] for k in ("exact_memorization", "overall")
        }


@pytest.mark.slow
def test_retain_model_may_be_the_base_itself(server: LiveServer, variant: dict[str, Any], probes: dict[str, Any]) -> None:
    """Against the base as its own retain model the base's memorization values are all 0 (rescaled
    by a span of 0, the base agreeing with itself) and its privacy AUCs exactly 0.5."""
    small = {"forget": probes["forget"], "retain": probes["retain"][:5]}
    job = _evaluate_job(server.client, variant["variant_id"], {**small, "metrics": "tofu", "retain_model": BASE})
    result = job["result"]
    n = len(small["forget"]) + len(small["retain"])  # NLL/EM on two models, then the suite on three
    assert job["progress"]["done"] == job["progress"]["total"] == 2 * n + 3 * n
    base = result["tofu"]["base"]["values"]
    assert base["forget_quality"] == pytest.approx(1.0)
    for attack in tm.MIA_ATTACKS:
        assert base[f"{attack}_auc_vs_retain"] == pytest.approx(0.5, abs=TOLERANCE)
    assert result["tofu"]["retain"]["values"] == base


@pytest.mark.slow
def test_bad_metric_requests_are_problems(server: LiveServer, variant: dict[str, Any], probes: dict[str, Any]) -> None:
    api, variant_id = server.client, variant["variant_id"]
    small = {"forget": probes["forget"][:2]}
    unknown = _post(api, variant_id, {**small, "metrics": ["exact_memorization", "rouge_everything"]})
    assert_problem(unknown, 422, "rouge_everything", "exact_memorization", "forget_truth_ratio", "mia_min_k")
    vocab = _post(api, variant_id, {**small, "metrics": "tofu", "retain_model": OTHER})
    assert_problem(vocab, 422, OTHER, "vocabulary")
    missing = _post(api, variant_id, {**small, "metrics": "tofu", "retain_model": "tofu-eval/nobody"})
    assert_problem(missing, 404, "tofu-eval/nobody")
    assert_problem(_post(api, variant_id, {**small, "retain_model": RETAIN}), 422, "metrics")
    assert_problem(_post(api, variant_id, {"retain": probes["retain"][:2], "metrics": "tofu"}), 422, "forget")
    too_many = {**small["forget"][0], "perturbed_answers": ["x"] * 21}
    assert_problem(_post(api, variant_id, {"forget": [too_many], "metrics": "tofu"}), 422, "perturbed_answers")


def test_cli_prints_one_tofu_table() -> None:
    """``engram evaluate --metrics tofu``'s table: a row per metric name, a column per model, ``-``
    where a model left a metric out (listed with its reason), ``-inf`` for a forget quality of 0."""
    summary = {"mean_nll": 1.0, "exact_match": 1.0, "n": 1}
    record = {
        "split": "forget",
        "index": 0,
        "base": {"nll": 1.0, "exact_match": True},
        "variant": {"nll": 2.0, "exact_match": False},
    }
    result = EvaluationResult.model_validate(
        {
            "variant_id": "v1",
            "summary": {"base": {"forget": summary}, "variant": {"forget": summary}},
            "records": [record],
            "retain_model": "m/retain",
            "tofu": {
                "base": {"values": {"exact_memorization": 0.75, "overall": 0.5}, "left_out": {}},
                "variant": {
                    "values": {"exact_memorization": 0.125, "forget_quality_log10": None},
                    "left_out": {"overall": "needs privacy"},
                },
                "retain": {"values": {"exact_memorization": 0.25, "overall": 1.0}, "left_out": {}},
            },
        }
    )
    with stdout.capture() as captured:
        render_evaluation(result)
    lines = [line.replace("┃", " ").replace("│", " ") for line in captured.get().splitlines()]  # rich's rules
    header = next(line for line in lines if line.split()[:4] == ["metric", "base", "variant", "retain"])
    rows = {line.split()[0]: line.split()[1:] for line in lines[lines.index(header) + 1 :] if line.split()}
    assert rows["exact_memorization"] == ["0.75", "0.125", "0.25"]
    assert rows["overall"] == ["0.5", "-", "1"]
    assert rows["forget_quality_log10"] == ["-", "-inf", "-"]
    assert "left out: overall: needs privacy" in captured.get()
    assert "m/retain" in captured.get()


def test_chat_probes_answers_are_rendered_once_before_scoring(tmp_path: Path) -> None:
    """The job renders every answer of a chat probe (the answer, the paraphrase, each wrong answer)
    in its bounded template process before any model runs, and scores from those renders after the
    process ended: the statistics equal those rendered by ``apply_chat_template`` at scoring time."""
    from service.engine.chat import InProcess, RenderedOnce
    from service.evaluation.run import encoded_sets  # the job's own steps, without a server

    folder = make_tiny_chat_llama(tmp_path / "chat", CHAT_TEMPLATE)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    probe: dict[str, object] = {
        "messages": [{"role": "user", "content": "Where was Ada born?"}, {"role": "assistant", "content": " Quillmoor"}],
        "paraphrased_answer": " the town of Quillmoor",
        "perturbed_answers": [" the town of Vrymfyx", " the town of Koudro"],
    }
    sets = {"forget": [tofu_probe(probe)]}
    renderer = RenderedOnce(InProcess())
    encoded_sets(tokenizer, sets, renderer, None)
    renderer.inner = None  # the process has ended: a render not primed would fail the job
    served = tofu_statistics(model, tokenizer, sets["forget"], renderer=renderer)
    assert served == tofu_statistics(model, tokenizer, sets["forget"], renderer=InProcess())
    assert served[0].perturbed is not None and len(served[0].perturbed) == 2
