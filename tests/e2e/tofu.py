"""The mini-TOFU scenario, shared by the embedded and the distributed end-to-end tests.

A tiny Llama memorised 200 synthetic facts (``mini_tofu_demo`` in conftest). Through the live API
the service unlearns the 10% forget set with the other 90% as reference (α=1, uniform); the
downloaded checkpoint must forget, retain, and agree with ai-engram's edit of the same model and data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import engram
import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.demo import read_probes
from engram_fixtures.live import download_variant, wait_for_job
from service.engine.evaluate import TextProbe, answer_nll, greedy_exact_match, summarize
from tests.helpers.api import register_model


def probe_metrics(model: torch.nn.Module, tokenizer: object, probes: list[TextProbe]) -> dict[str, float]:
    return summarize(answer_nll(model, tokenizer, probes), greedy_exact_match(model, tokenizer, probes))


def post_concept(client: httpx.Client, model_id: str, name: str, role: str, probes: list[TextProbe]) -> str:
    records = [{"prompt": p.prompt, "completion": p.completion} for p in probes]
    response = client.post("/concepts", json={"name": name, "role": role, "models": [model_id], "records": records})
    assert response.status_code == 202, response.text
    return response.json()["jobs"][0]["job_id"]


def run_mini_tofu(client: httpx.Client, demo_root: Path, source: str, work: Path, model_id: str) -> dict[str, Any]:
    """Register, collect, unlearn, download and evaluate; assert the forgetting and the oracle.

    Args:
        client: bound to a live server.
        demo_root: the folder holding ``demo/model``, ``demo/forget.jsonl``, ``demo/retain.jsonl``.
        source: the model source to register (``file://…`` or ``s3://…``).
        work: a scratch folder for the download.
        model_id: the ID to register the model under.

    Returns:
        The figures (NLL and exact match, forget and retain, for base, service and ai-engram) and
        the jobs that ran, for scenario-specific checks.
    """
    model_dir = demo_root / "demo" / "model"
    forget = read_probes(demo_root / "demo" / "forget.jsonl")
    retain = read_probes(demo_root / "demo" / "retain.jsonl")
    register_model(client, model_id, source)
    prefix = model_id.replace("/", "-")
    jobs = [
        wait_for_job(client, post_concept(client, model_id, f"{prefix}-{name}", role, probes), timeout=300)
        for name, role, probes in (("forget", "target", forget), ("retain", "reference", retain))
    ]
    assert [j["status"] for j in jobs] == ["succeeded", "succeeded"], jobs
    submitted = client.post(f"/models/{model_id}/unlearn", json={"concepts": [f"{prefix}-forget"], "alpha": 1.0})
    assert submitted.status_code == 202, submitted.text
    jobs.append(wait_for_job(client, submitted.json()["job"]["job_id"], timeout=300))
    assert jobs[-1]["status"] == "succeeded", jobs[-1]
    variant = client.get(f"/variants/{submitted.json()['variant']['variant_id']}").json()
    edited_dir = download_variant(client, variant, work / "variant")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    edited = AutoModelForCausalLM.from_pretrained(edited_dir).eval()
    forget_pairs = [(p.prompt, p.completion) for p in forget]
    retain_pairs = [(p.prompt, p.completion) for p in retain]
    oracle = engram.edit_llm(base, tokenizer, forget=forget_pairs, total=forget_pairs + retain_pairs, alpha=1.0)
    figures = {
        name: {"forget": probe_metrics(m, tokenizer, forget), "retain": probe_metrics(m, tokenizer, retain)}
        for name, m in (("base", base), ("service", edited), ("ai-engram", oracle))
    }
    print("\nmini-TOFU figures:\n" + json.dumps(figures, indent=1))  # noqa: T201 - the note's figures
    _assert_forgets_and_retains(figures)
    _assert_same_edit_as_oracle(base, edited, oracle)
    return {"figures": figures, "jobs": jobs, "variant": variant}


def _assert_forgets_and_retains(figures: dict[str, Any]) -> None:
    before, after = figures["base"], figures["service"]
    forget_rise = after["forget"]["mean_nll"] / before["forget"]["mean_nll"]
    retain_rise = after["retain"]["mean_nll"] / before["retain"]["mean_nll"]
    assert before["forget"]["exact_match"] >= 0.9, "the demo model had not memorised its facts"
    assert before["retain"]["exact_match"] >= 0.9, "the demo model had not memorised its facts"
    assert forget_rise >= 10.0, figures
    assert forget_rise >= 3.0 * retain_rise, figures
    for split in ("forget", "retain"):  # agreement with the oracle: answer NLLs within 5%
        ours, theirs = after[split]["mean_nll"], figures["ai-engram"][split]["mean_nll"]
        assert abs(ours - theirs) <= 0.05 * theirs, (split, ours, theirs)


def _assert_same_edit_as_oracle(base: torch.nn.Module, edited: torch.nn.Module, oracle: torch.nn.Module) -> None:
    """The edit itself (W_new − W) agrees with ai-engram's to 2% on every parameter it changed."""
    base_params, oracle_params = dict(base.named_parameters()), dict(oracle.named_parameters())
    for name, param in edited.named_parameters():
        delta_oracle = oracle_params[name].detach().double() - base_params[name].detach().double()
        delta_ours = param.detach().double() - base_params[name].detach().double()
        if float(delta_oracle.norm()) == 0.0:
            assert float(delta_ours.norm()) == 0.0, name
            continue
        assert float((delta_ours - delta_oracle).norm() / delta_oracle.norm()) < 0.02, name
