"""Mini-TOFU through the live API: a tiny Llama memorises 200 synthetic facts, the service unlearns
10% of them with the other 90% as reference, and the downloaded checkpoint really forgets.

The same model and data are edited with ai-engram (the paper authors' library) as the oracle.
Run `pytest tests/e2e -s` to see the figures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import engram
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.demo import build_demo, read_probes
from service.engine.evaluate import Probe, answer_nll, greedy_exact_match, summarize
from tests.live import LiveServer, start_server, stop_server, wait_for_job

MODEL_ID = "demo/mini-tofu"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tofu")
    build_demo(root / "models" / "demo", n_facts=200, forget_fraction=0.1, seed=0)
    return root


@pytest.fixture(scope="module")
def server(demo: Path) -> Iterator[LiveServer]:
    live = start_server(demo / "store", demo / "models", demo / "server.log")
    try:
        yield live
    finally:
        stop_server(live)


def _metrics(model: torch.nn.Module, tokenizer: object, probes: list[Probe]) -> dict[str, float]:
    return summarize(answer_nll(model, tokenizer, probes), greedy_exact_match(model, tokenizer, probes))


def _post_concept(client: httpx.Client, name: str, role: str, probes: list[Probe]) -> str:
    records = [{"prompt": p.prompt, "completion": p.completion} for p in probes]
    body = {"name": name, "role": role, "models": [MODEL_ID], "records": records}
    response = client.post("/concepts", json=body)
    assert response.status_code == 202, response.text
    return response.json()["jobs"][0]["job_id"]


def _download(client: httpx.Client, variant: dict, target: Path) -> Path:
    target.mkdir(parents=True)
    for entry in variant["files"]:
        response = client.get(f"/variants/{variant['variant_id']}/files/{entry['path']}")
        assert response.status_code == 200
        (target / entry["path"]).write_bytes(response.content)
    return target


def test_mini_tofu_forgets_and_retains_like_the_oracle(demo: Path, server: LiveServer, tmp_path: Path) -> None:
    model_dir = demo / "models" / "demo" / "model"
    forget = read_probes(demo / "models" / "demo" / "forget.jsonl")
    retain = read_probes(demo / "models" / "demo" / "retain.jsonl")
    client = server.client
    assert client.post("/models", json={"model_id": MODEL_ID, "source": f"file://{model_dir}"}).status_code == 201
    for job_id in (_post_concept(client, "forget", "target", forget), _post_concept(client, "retain", "reference", retain)):
        assert wait_for_job(client, job_id)["status"] == "succeeded"

    submitted = client.post(f"/models/{MODEL_ID}/unlearn", json={"concepts": ["forget"], "alpha": 1.0})
    assert submitted.status_code == 202, submitted.text
    assert wait_for_job(client, submitted.json()["job"]["job_id"])["status"] == "succeeded"
    variant = client.get(f"/variants/{submitted.json()['variant']['variant_id']}").json()
    edited_dir = _download(client, variant, tmp_path / "variant")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    edited = AutoModelForCausalLM.from_pretrained(edited_dir).eval()
    forget_pairs = [(p.prompt, p.completion) for p in forget]
    retain_pairs = [(p.prompt, p.completion) for p in retain]
    oracle = engram.edit_llm(base, tokenizer, forget=forget_pairs, total=forget_pairs + retain_pairs, alpha=1.0)

    figures = {
        name: {"forget": _metrics(m, tokenizer, forget), "retain": _metrics(m, tokenizer, retain)}
        for name, m in (("base", base), ("service", edited), ("ai-engram", oracle))
    }
    print("\nmini-TOFU figures:\n" + json.dumps(figures, indent=1))  # noqa: T201 - the note's figures

    before, after = figures["base"], figures["service"]
    forget_rise = after["forget"]["mean_nll"] / before["forget"]["mean_nll"]
    retain_rise = after["retain"]["mean_nll"] / before["retain"]["mean_nll"]
    assert before["forget"]["exact_match"] >= 0.9 and before["retain"]["exact_match"] >= 0.9  # it had memorised
    assert forget_rise >= 10.0, figures
    assert forget_rise >= 3.0 * retain_rise, figures
    # Agreement with the oracle: answer NLLs within 5% (relative), on both sets.
    for split in ("forget", "retain"):
        ours, theirs = after[split]["mean_nll"], figures["ai-engram"][split]["mean_nll"]
        assert abs(ours - theirs) <= 0.05 * theirs, (split, ours, theirs)
    # And the weights themselves: the edit (W_new − W) agrees with ai-engram's to 2%.
    base_params, oracle_params = dict(base.named_parameters()), dict(oracle.named_parameters())
    for name, param in edited.named_parameters():
        delta_ours = param.detach().double() - base_params[name].detach().double()
        delta_oracle = oracle_params[name].detach().double() - base_params[name].detach().double()
        scale = delta_oracle.norm().clamp_min(1e-12)
        assert float((delta_ours - delta_oracle).norm() / scale) < 0.02 or float(delta_oracle.norm()) == 0.0, name
