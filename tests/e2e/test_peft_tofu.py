"""Mini-TOFU as a PEFT adapter: the same unlearning as a checkpoint and as ``format: "peft"``.

Through the live API (embedded mode) the forget set is unlearned twice; the downloaded adapter,
applied with ``PeftModel.from_pretrained``, must forget and retain like the checkpoint variant
(answer NLLs within 5%). A rank-capped adapter shows what truncation costs.

Run ``pytest tests/e2e/test_peft_tofu.py -s`` to see the figures.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.demo import read_probes
from service.engine.evaluate import Probe
from service.engine.lora import EXACT_RTOL
from tests.e2e.tofu import post_concept, probe_metrics
from tests.live import LiveServer, download_variant, wait_for_job

MODEL_ID = "demo/peft-tofu"
NLL_TOL = 0.05  # the bar: forget and retain NLLs within 5% of the checkpoint variant's
TRUNCATED_RANK = 16


@pytest.fixture(scope="module")
def probes(mini_tofu_demo: Path) -> dict[str, list[Probe]]:
    demo = mini_tofu_demo / "demo"
    return {"forget": read_probes(demo / "forget.jsonl"), "retain": read_probes(demo / "retain.jsonl")}


@pytest.fixture(scope="module")
def collected(tofu_server: LiveServer, mini_tofu_demo: Path, probes: dict[str, list[Probe]]) -> LiveServer:
    """The demo model registered, forget (target) and retain (reference) statistics ready."""
    client = tofu_server.client
    source = f"file://{mini_tofu_demo / 'demo' / 'model'}"
    assert client.post("/models", json={"model_id": MODEL_ID, "source": source}).status_code == 201
    for name, role in (("forget", "target"), ("retain", "reference")):
        job = wait_for_job(client, post_concept(client, MODEL_ID, f"peft-{name}", role, probes[name]), timeout=300)
        assert job["status"] == "succeeded", job
    return tofu_server


def unlearn(client: httpx.Client, target: Path, **options: Any) -> dict[str, Any]:
    """Unlearn the forget set (α=1, uniform) in the given format; download the ready variant."""
    body = {"concepts": ["peft-forget"], "alpha": 1.0, **options}
    submitted = client.post(f"/models/{MODEL_ID}/unlearn", json=body)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(client, submitted.json()["job"]["job_id"], timeout=300)
    assert job["status"] == "succeeded", job
    assert job["progress"]["done"] == job["progress"]["total"] > 0, job["progress"]
    variant = client.get(f"/variants/{submitted.json()['variant']['variant_id']}").json()
    download_variant(client, variant, target)
    return variant


def metrics(model: torch.nn.Module, tokenizer: Any, probes: dict[str, list[Probe]]) -> dict[str, dict[str, float]]:
    """Mean answer NLL and greedy exact match per split, as the mini-TOFU scenario measures them."""
    return {split: probe_metrics(model, tokenizer, items) for split, items in probes.items()}


def with_adapter(model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def summary(variant: dict[str, Any]) -> dict[str, Any]:
    """The report's figures for the closing note: rank spread and errors."""
    layers = variant["lora"]["layers"].values()
    ranks = sorted(layer["rank"] for layer in layers)
    return {
        "r": variant["lora"]["r"],
        "ranks": f"{ranks[0]}..{ranks[-1]} (median {ranks[len(ranks) // 2]})",
        **{k: variant["lora"]["totals"][k] for k in ("relative_error", "max_relative_error", "max_stored_relative_error")},
        "min_kept_energy": variant["lora"]["totals"]["min_kept_energy"],
        "parameters": variant["lora"]["totals"]["parameters"],
        "dense_parameters": variant["lora"]["totals"]["dense_parameters"],
    }


def test_peft_adapter_forgets_and_retains_like_the_checkpoint(
    collected: LiveServer, mini_tofu_demo: Path, probes: dict[str, list[Probe]], tmp_path: Path
) -> None:
    client, model_dir = collected.client, mini_tofu_demo / "demo" / "model"
    checkpoint = unlearn(client, tmp_path / "checkpoint", format="checkpoint")
    exact = unlearn(client, tmp_path / "peft", format="peft")
    truncated = unlearn(client, tmp_path / "peft-r16", format="peft", lora_rank=TRUNCATED_RANK)
    assert len({checkpoint["variant_id"], exact["variant_id"], truncated["variant_id"]}) == 3
    assert {f["path"] for f in exact["files"]} == {"adapter_config.json", "adapter_model.safetensors", "lora_report.json"}
    assert json.loads((tmp_path / "peft" / "lora_report.json").read_text()) == exact["lora"]
    assert (exact["lora_rank"], truncated["lora_rank"]) == (None, TRUNCATED_RANK)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on loading are expected (see service.engine.lora)
        figures = {
            "base": metrics(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tokenizer, probes),
            "checkpoint": metrics(AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").eval(), tokenizer, probes),
            "peft exact": metrics(with_adapter(model_dir, tmp_path / "peft"), tokenizer, probes),
            f"peft r={TRUNCATED_RANK}": metrics(with_adapter(model_dir, tmp_path / "peft-r16"), tokenizer, probes),
        }
    report = {"rtol": EXACT_RTOL, "exact": summary(exact), f"r={TRUNCATED_RANK}": summary(truncated)}
    print("\nmini-TOFU as PEFT (mean answer NLL, greedy exact match):\n" + json.dumps(figures, indent=1))  # noqa: T201 - the note's figures
    print("adapter reports:\n" + json.dumps(report, indent=1))  # noqa: T201

    forgot = figures["checkpoint"]["forget"]["mean_nll"] / figures["base"]["forget"]["mean_nll"]
    assert forgot >= 10, figures  # the edit being reproduced did forget
    for split in ("forget", "retain"):
        ours, reference = figures["peft exact"][split]["mean_nll"], figures["checkpoint"][split]["mean_nll"]
        assert abs(ours - reference) <= NLL_TOL * reference, (split, ours, reference)
    assert exact["lora"]["totals"]["truncated_layers"] == 0
    assert exact["lora"]["totals"]["max_relative_error"] < 1e-5
    assert truncated["lora"]["r"] == TRUNCATED_RANK
    assert truncated["lora"]["totals"]["truncated_layers"] > 0
    assert all(layer["relative_error"] > 0 for layer in truncated["lora"]["layers"].values())
