"""POST /variants/{id}/evaluate and /generate through the live server, against direct computation.

The session's tiny Llama has random weights, so its NLLs are near ln(vocab) and its greedy answers
are noise; what matters here is that the service's numbers are exactly those of the downloaded
artifact scored directly with the same functions (tolerance 1e-5 relative), for both the
checkpoint and the delta format, and that bad requests are 4xx problems that change nothing.
(An unknown variant's 404 needs no variant: it runs on the app in this process, ``app_server``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, download_variant, wait_concepts_ready, wait_for_job, wait_variant_ready
from service.engine.evaluate import TextProbe, answer_nll, greedy_exact_match, greedy_tokens, summarize
from tests.helpers.api import assert_problem, register_model
from tests.helpers.app import InProcessServer

MODEL = "eval/tiny"
FACTS = make_facts(30, seed=3)
FORGET = [{"prompt": p, "completion": c} for p, c in FACTS[:5]]
RETAIN = [{"prompt": p, "completion": c} for p, c in FACTS[5:15]]
REL_TOL = 1e-5


def _variant(api: httpx.Client, fmt: str) -> dict[str, Any]:
    response = api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["eval-forget"], "alpha": 1.0, "format": fmt})
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(api, response.json()["variant"]["variant_id"])


@pytest.fixture(scope="module")
def variants(api: httpx.Client, tiny_llama_dir: Path) -> dict[str, dict[str, Any]]:
    register_model(api, MODEL, f"file://{tiny_llama_dir}", existing_ok=True)
    for name, role, records in (("eval-forget", "target", FORGET), ("eval-retain", "reference", RETAIN)):
        response = api.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": records})
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["eval-forget", "eval-retain"], MODEL)
    return {fmt: _variant(api, fmt) for fmt in ("checkpoint", "delta", "peft")}


def _evaluate(api: httpx.Client, variant_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post(f"/variants/{variant_id}/evaluate", params={"wait": 30}, json=body)
    assert response.status_code in (200, 202), response.text
    job = response.json() if response.status_code == 200 else wait_for_job(api, response.json()["job_id"])
    assert job["kind"] == "evaluate" and job["status"] == "succeeded", job
    return job


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1e-12)


def _direct(model: Any, tokenizer: Any, records: list[dict[str, str]]) -> tuple[list[float], list[bool]]:
    probes = [TextProbe(r["prompt"], r["completion"]) for r in records]
    return answer_nll(model, tokenizer, probes, batch_size=3), greedy_exact_match(model, tokenizer, probes, batch_size=3)


def test_evaluation_equals_direct_computation(
    api: httpx.Client, variants: dict[str, dict[str, Any]], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    checkpoint = variants["checkpoint"]
    job = _evaluate(api, checkpoint["variant_id"], {"forget": FORGET, "retain": RETAIN})
    result = job["result"]
    assert job["progress"]["done"] == job["progress"]["total"] == 2 * (len(FORGET) + len(RETAIN))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    models = {
        "base": AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval(),
        "variant": AutoModelForCausalLM.from_pretrained(download_variant(api, checkpoint, tmp_path / "ckpt")).eval(),
    }
    records = {s: [r for r in result["records"] if r["split"] == s] for s in ("forget", "retain")}
    for name, model in models.items():
        for split, probes in (("forget", FORGET), ("retain", RETAIN)):
            nll, em = _direct(model, tokenizer, probes)
            served = records[split]
            assert [r["index"] for r in served] == list(range(len(probes)))
            assert all(_close(r[name]["nll"], x) for r, x in zip(served, nll, strict=True)), (name, split)
            assert [r[name]["exact_match"] for r in served] == em, (name, split)
            expected = summarize(nll, em)
            summary = result["summary"][name][split]
            assert summary["n"] == expected["n"] and _close(summary["mean_nll"], expected["mean_nll"])
            assert summary["exact_match"] == pytest.approx(expected["exact_match"])
    base_forget, variant_forget = result["summary"]["base"]["forget"], result["summary"]["variant"]["forget"]
    assert variant_forget["mean_nll"] != base_forget["mean_nll"], "the variant must differ from its base"


@pytest.mark.parametrize("fmt", ["delta", "peft"])
def test_other_formats_evaluate_like_the_checkpoint(
    api: httpx.Client, variants: dict[str, dict[str, Any]], fmt: str
) -> None:
    """The delta is applied on the base (untied head included), the LoRA adapter served unmerged
    with peft: the same edit, so the same numbers (the exact-rank adapter is exact to ~1e-6)."""
    body = {"forget": FORGET}
    from_checkpoint = _evaluate(api, variants["checkpoint"]["variant_id"], body)["result"]
    from_other = _evaluate(api, variants[fmt]["variant_id"], body)["result"]
    tolerance = REL_TOL if fmt == "delta" else 1e-4
    for ours, theirs in zip(from_other["records"], from_checkpoint["records"], strict=True):
        assert abs(ours["variant"]["nll"] - theirs["variant"]["nll"]) <= tolerance * theirs["variant"]["nll"], (ours, theirs)
        assert ours["variant"]["exact_match"] == theirs["variant"]["exact_match"]
    assert "retain" not in from_other["summary"]["variant"]  # no retain probes: no retain summary


def test_same_evaluation_again_is_answered_from_storage(api: httpx.Client, variants: dict[str, dict[str, Any]]) -> None:
    body = {"forget": FORGET[:2], "retain": RETAIN[:2]}
    first = _evaluate(api, variants["checkpoint"]["variant_id"], body)
    again = _evaluate(api, variants["checkpoint"]["variant_id"], body)
    # Issue 35, finding 9: the identical request is answered by the job that stored the result.
    assert again["job_id"] == first["job_id"] and again["result"] == first["result"]


def test_generate_is_the_greedy_continuation(
    api: httpx.Client, variants: dict[str, dict[str, Any]], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    variant = variants["checkpoint"]
    prompt, max_new = FORGET[0]["prompt"], 12
    body = {"prompt": prompt, "max_new_tokens": max_new}
    response = api.post(f"/variants/{variant['variant_id']}/generate", params={"wait": 30}, json=body)
    assert response.status_code in (200, 202), response.text
    job = response.json() if response.status_code == 200 else wait_for_job(api, response.json()["job_id"])
    assert job["status"] == "succeeded", job
    outputs = job["result"]["outputs"]
    assert set(outputs) == {"base", "variant"}
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    directories = {"base": tiny_llama_dir, "variant": download_variant(api, variant, tmp_path / "v")}
    long_enough = TextProbe(prompt, " x" * 4 * max_new)  # the hand-rolled greedy decoder, no KV cache
    for name, directory in directories.items():
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        expected = greedy_tokens(model, tokenizer, [long_enough], max_new_tokens=max_new)[0]
        served = outputs[name]["token_ids"]
        assert 1 <= len(served) <= max_new
        assert served == expected[: len(served)], name
        if len(served) < max_new:  # generation stopped early: only at the end-of-sequence token
            assert served[-1] == tokenizer.eos_token_id
        assert outputs[name]["text"] == tokenizer.decode(served, skip_special_tokens=True)


def test_generate_only_the_variant(api: httpx.Client, variants: dict[str, dict[str, Any]]) -> None:
    body = {"prompt": "Q: hello", "max_new_tokens": 3, "models": ["variant"]}
    response = api.post(f"/variants/{variants['delta']['variant_id']}/generate", params={"wait": 30}, json=body)
    job = response.json() if response.status_code == 200 else wait_for_job(api, response.json()["job_id"])
    assert set(job["result"]["outputs"]) == {"variant"}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({}, 422),  # no probes at all
        ({"forget": [{"prompt": "q"}]}, 422),  # no completion
        ({"forget": [{"prompt": "", "completion": "a"}]}, 422),
        ({"forget": [{"prompt": "q", "completion": "a", "extra": 1}]}, 422),
        ({"forget": FORGET, "callback_url": "http://elsewhere.example/hook"}, 422),  # not allowlisted
    ],
)
def test_bad_evaluate_requests_are_problems(
    api: httpx.Client, live_server: LiveServer, variants: dict[str, dict[str, Any]], body: dict[str, Any], status: int
) -> None:
    before = sorted(p.name for p in (live_server.storage_dir / "jobs").glob("*.json"))
    assert_problem(api.post(f"/variants/{variants['checkpoint']['variant_id']}/evaluate", json=body), status)
    assert sorted(p.name for p in (live_server.storage_dir / "jobs").glob("*.json")) == before


@pytest.mark.fast
def test_evaluate_unknown_variant_is_404(app_server: InProcessServer) -> None:
    api = app_server.client
    assert_problem(api.post("/variants/0123456789abcdef0123456789abcdef/evaluate", json={"forget": FORGET}), 404)
    assert_problem(api.post("/variants/nope/generate", json={"prompt": "x"}), 404)


def test_generate_bounds_are_checked(api: httpx.Client, variants: dict[str, dict[str, Any]]) -> None:
    url = f"/variants/{variants['checkpoint']['variant_id']}/generate"
    assert_problem(api.post(url, json={"prompt": "x", "max_new_tokens": 0}), 422)
    assert_problem(api.post(url, json={"prompt": "x", "max_new_tokens": 5000}), 422)
    assert_problem(api.post(url, json={"prompt": "x", "models": ["other"]}), 422)
    assert_problem(api.post(url, params={"wait": 999}, json={"prompt": "x"}), 422)
