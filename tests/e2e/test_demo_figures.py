"""The README's and the tutorial's figures on the mini-TOFU demo, through the live API.

Every row of the tutorial's table is one ``unlearn`` body (:data:`SETTINGS`), built and scored by
the service itself (``POST /variants/{id}/evaluate``: greedy exact match and answer NLL of the
shipped checkpoint, the metrics ``python -m engram_fixtures.demo evaluate`` prints), and printed as
the table shows it: ``OMP_NUM_THREADS=1 pytest -s -q tests/e2e/test_demo_figures.py`` gives the
rows. The README's rows, read from the README (tests/helpers/readme_figures.py), must hold within
the spread the demo shows between CPUs (its weights depend on the CPU that trains it: the
tutorial says by how much); the W-Norm α=1.5 edit still raises the forgotten answers' NLL ×100.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import read_probes
from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job, wait_variant_ready
from tests.helpers.api import register_model
from tests.helpers.readme_figures import ALPHA_1, BASE_ROW, assert_near, readme_figures

MODEL = "demo/readme-figures"
MLP = ["gate_proj", "up_proj", "down_proj"]
SPLITS = ("forget", "retain")
# The tutorial's table, row by row (the README's rows are among them): each one unlearn body.
SETTINGS: list[dict[str, Any]] = [
    {"alpha": 1.0},
    {"alpha": 0.5},
    {"alpha": 1.0, "modules": ["q_proj", "k_proj", "gate_proj"]},
    {"alpha": 2.0, "scaling": "weight_norm", "modules": MLP},
    {"alpha": 1.5, "scaling": "weight_norm", "modules": MLP},
]


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
    return {table_cell(options): _score(api, options, bodies) for options in SETTINGS}


def _score(api: httpx.Client, options: dict[str, Any], probes: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    submitted = api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["readme-forget"], **options})
    assert submitted.status_code == 202, submitted.text
    variant = wait_variant_ready(api, submitted.json()["variant"]["variant_id"], timeout=600)
    evaluated = api.post(f"/variants/{variant['variant_id']}/evaluate", json=probes)
    assert evaluated.status_code in (200, 202), evaluated.text
    job = wait_for_job(api, evaluated.json()["job_id"], timeout=600)
    assert job["status"] == "succeeded", job
    summary = job["result"]["summary"]
    print(f"\n{table_row(options, summary)}")  # noqa: T201 - the tutorial's table, row by row
    return summary


def table_cell(options: dict[str, Any]) -> str:
    """The body as the README's and the tutorial's tables show it (``"alpha": 1.0, "modules": [...]``)."""
    return ", ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in options.items())


def table_row(options: dict[str, Any], summary: dict[str, Any]) -> str:
    """The tutorial's row: exact match / mean answer NLL of forget and retain, as it rounds them."""
    cells = [f"{summary['variant'][s]['exact_match']:.3f} / {_nll(summary['variant'][s]['mean_nll'])}" for s in SPLITS]
    return f"| `{table_cell(options)}` | {cells[0]} | {cells[1]} |"


def _nll(value: float) -> str:
    return f"{value:.3g}" if value >= 1 else f"{value:.3f}"  # three significant digits, 0.050 as 0.050


def _percent(summary: dict[str, Any], model: str, split: str) -> float:
    return 100.0 * float(summary[model][split]["exact_match"])


def test_every_row_of_the_readmes_table_holds(scored: dict[str, Any]) -> None:
    figures = readme_figures()
    base = scored[ALPHA_1]
    for index, split in enumerate(SPLITS):
        assert_near(_percent(base, "base", split), figures[BASE_ROW][index], f"base {split}")
    rows = [row for row in figures if row != BASE_ROW]
    assert set(rows) <= set(scored), f"a README row this test does not score: {set(rows) - set(scored)}"
    for row in rows:
        for index, split in enumerate(SPLITS):
            assert_near(_percent(scored[row], "variant", split), figures[row][index], f"{split} ({row})")


def test_weight_norm_at_alpha_1_5_still_raises_the_forgotten_answers_nll(scored: dict[str, Any]) -> None:
    gentle = scored[table_cell(SETTINGS[-1])]
    forget_rise = gentle["variant"]["forget"]["mean_nll"] / gentle["base"]["forget"]["mean_nll"]
    assert forget_rise >= 100, gentle  # the tutorial: ×200
