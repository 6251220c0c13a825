"""The README walk-through's figures on the mini-TOFU demo hold, through the live API.

The README says what a newcomer will see: the walk-through's request (α=1, every layer) forgets
every fact but drops retain exact match to about 41%, and W-Norm scaling on the MLP modules forgets
every fact while keeping most retained ones (α=2: 84%), or nearly all of them (α=1.5: 97%) with
the forgotten answers' NLL still far up. Each variant here is built and scored by the service itself
(``POST /variants/{id}/evaluate``: greedy exact match and answer NLL of the shipped checkpoint, the
metrics ``python -m engram_fixtures.demo evaluate`` prints). The bounds leave room for the few-percent
differences a retrained demo shows on another machine (thread counts change float summation order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import read_probes
from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job, wait_variant_ready
from tests.helpers.api import register_model

MODEL = "demo/readme-figures"
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def scored(mini_tofu_demo: Path, tofu_server: LiveServer) -> dict[str, Any]:
    """Register the demo, collect forget and retain, and score the README's settings."""
    api = tofu_server.client
    demo = mini_tofu_demo / "demo"
    source = f"file://{demo / 'model'}"
    register_model(api, MODEL, source)
    probes = {split: read_probes(demo / f"{split}.jsonl") for split in ("forget", "retain")}
    bodies = {split: [{"prompt": p.prompt, "completion": p.completion} for p in probes[split]] for split in probes}
    for split, role in (("forget", "target"), ("retain", "reference")):
        body = {"name": f"readme-{split}", "role": role, "models": [MODEL], "records": bodies[split]}
        assert api.post("/concepts", json=body).status_code == 202
    wait_concepts_ready(api, ["readme-forget", "readme-retain"], MODEL, timeout=600)
    settings = {
        "alpha 1": {"alpha": 1.0},
        "mlp weight_norm alpha 2": {"alpha": 2.0, "scaling": "weight_norm", "modules": MLP},
        "mlp weight_norm alpha 1.5": {"alpha": 1.5, "scaling": "weight_norm", "modules": MLP},
    }
    return {name: _score(api, options, bodies) for name, options in settings.items()}


def _score(api: httpx.Client, options: dict[str, Any], probes: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    submitted = api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["readme-forget"], **options})
    assert submitted.status_code == 202, submitted.text
    variant = wait_variant_ready(api, submitted.json()["variant"]["variant_id"], timeout=600)
    evaluated = api.post(f"/variants/{variant['variant_id']}/evaluate", json=probes)
    assert evaluated.status_code in (200, 202), evaluated.text
    job = wait_for_job(api, evaluated.json()["job_id"], timeout=600)
    assert job["status"] == "succeeded", job
    summary = job["result"]["summary"]
    print(f"\n{options}: {summary}")  # noqa: T201 - the README's table
    return summary


def test_the_walkthrough_request_forgets_everything_and_damages_retain(scored: dict[str, Any]) -> None:
    base, variant = scored["alpha 1"]["base"], scored["alpha 1"]["variant"]
    assert base["forget"]["exact_match"] == 1.0 and base["retain"]["exact_match"] == 1.0, base
    assert variant["forget"]["exact_match"] <= 0.1, variant
    assert 0.2 <= variant["retain"]["exact_match"] <= 0.6, variant  # README: 41%


def test_weight_norm_on_the_mlp_forgets_and_keeps_most_of_retain(scored: dict[str, Any]) -> None:
    strong = scored["mlp weight_norm alpha 2"]["variant"]
    assert strong["forget"]["exact_match"] <= 0.1, strong  # README: 0%
    assert strong["retain"]["exact_match"] >= 0.75, strong  # README: 84%
    gentle = scored["mlp weight_norm alpha 1.5"]
    assert gentle["variant"]["retain"]["exact_match"] >= 0.9, gentle  # README: 97%
    forget_rise = gentle["variant"]["forget"]["mean_nll"] / gentle["base"]["forget"]["mean_nll"]
    assert forget_rise >= 50, gentle  # README: ×190
