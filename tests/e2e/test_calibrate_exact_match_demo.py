"""The default calibration on the README's tiny demo (issue 36): it decides by exact match.

A tiny Llama memorised 200 facts (mini-TOFU); the 20 forget facts are the concept removed, the 180
others the reference. Through the live API (embedded mode), a calibrate request with forget and
retain probes and no objective (the README's own call, no ``max_retain_nll_ratio``) minimises the
forget exact match with the retain exact match at least 0.9 × the base's and the perplexity on the
retain answers at most ×1.1, holding 20% of the probes out. Before issue 36 its recommendation (the
strongest forget NLL ratio within a retain NLL ratio of 2) left 70-90% of the forget facts answered,
without a word. The test asserts that the recommendation's forget exact match is well below the
base's (at most half of it) or that a warning says it is not, that the result shows exact match
beside the ratios, states its held-out margins and its cost, and that ``engram calibrate`` prints
the estimate before it starts and the warnings after.

Run ``pytest tests/e2e/test_calibrate_exact_match_demo.py -s`` to see the figures.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engram_fixtures.demo import read_probes
from engram_fixtures.live import REPO_ROOT, LiveServer, wait_for_job
from service.engine.evaluate import TextProbe
from tests.e2e.tofu import post_concept
from tests.helpers.api import register_model

MODEL_ID = "demo/calibrate-exact"
BUDGET = 12


def _pairs(probes: list[TextProbe]) -> list[dict[str, str]]:
    return [{"prompt": p.prompt, "completion": p.completion} for p in probes]


@pytest.fixture(scope="module")
def demo_probes(mini_tofu_demo: Path) -> dict[str, list[TextProbe]]:
    demo = mini_tofu_demo / "demo"
    forget, retain = read_probes(demo / "forget.jsonl"), read_probes(demo / "retain.jsonl")
    return {"forget": forget, "retain": random.Random(5).sample(retain, 40), "all_retain": retain}


@pytest.fixture(scope="module")
def collected(tofu_server: LiveServer, mini_tofu_demo: Path, demo_probes: dict[str, list[TextProbe]]) -> LiveServer:
    client = tofu_server.client
    register_model(client, MODEL_ID, f"file://{mini_tofu_demo / 'demo' / 'model'}")
    for name, role, items in (
        ("em-forget", "target", demo_probes["forget"]),
        ("em-retain", "reference", demo_probes["all_retain"]),
    ):
        job = wait_for_job(client, post_concept(client, MODEL_ID, name, role, items), timeout=300)
        assert job["status"] == "succeeded", job
    return tofu_server


def _body(probes: dict[str, list[TextProbe]]) -> dict[str, Any]:
    return {
        "concepts": ["em-forget"],
        "forget": _pairs(probes["forget"]),
        "retain": _pairs(probes["retain"]),
        "budget": BUDGET,
        "module_sets": ["all", "mlp"],
        "scalings": ["uniform"],
    }


def test_the_default_calibration_forgets_by_exact_match_or_says_it_does_not(
    collected: LiveServer, demo_probes: dict[str, list[TextProbe]]
) -> None:
    client = collected.client
    submitted = client.post(f"/models/{MODEL_ID}/calibrate", json=_body(demo_probes))
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(client, submitted.json()["job"]["job_id"], timeout=900)
    assert job["status"] == "succeeded", job
    result = job["result"]
    assert result["objective"] == {"metric": "forget_exact_match", "sense": "minimize"}
    assert {c["metric"] for c in result["constraints"]} == {"retain_exact_match", "perplexity_ratio"}
    assert result["perplexity_on"] == "retain"
    base_forget = result["base"]["forget"]["exact_match"]
    assert base_forget >= 0.9, "the demo model had not memorised its facts"
    rec = result["recommended"]
    assert rec is not None, result["note"]
    forget_em = rec["forget_exact_match"]
    assert forget_em == result["candidates"][rec["candidate"]]["forget"]["exact_match"]
    assert rec["retain_exact_match"] is not None and rec["forget_nll_ratio"] is not None
    held = result["held_out"]
    assert held["probes"] == {"forget": 4, "retain": 8}  # 20% of 20 and of 40
    assert set(held["margins"]) == {"min_retain_exact_match", "max_perplexity_ratio"}
    assert held["feasible"] == all(m >= 0 for m in held["margins"].values())
    held_forget = held["recommended"]["forget_exact_match"]
    warned = [w for w in result["warnings"] if "barely forgets" in w]
    assert forget_em <= 0.5 * base_forget or warned, result["warnings"]
    assert held_forget <= 0.5 * held["base"]["forget_exact_match"] or any("held-out forget" in w for w in warned)
    assert result["evaluations"] <= BUDGET and result["seconds"]["search"] > 0
    # the retain probes are the reference's own records, which the edit is built to spare: said, counted
    assert result["retain_probes_in_reference"] == {"em-retain": 40}
    assert any("all retain probes are records of the universe's concepts (em-retain (40))" in w for w in result["warnings"])
    print(  # noqa: T201 - the figures, with -s
        f"\ndefault calibration of the tiny demo: α={rec['options']['alpha']:.3g} {rec['options']['module_set']}; "
        f"forget exact {forget_em:.0%} (base {base_forget:.0%}, held out {held_forget:.0%}), "
        f"retain exact {rec['retain_exact_match']:.0%}, forget ×NLL {rec['forget_nll_ratio']:.3g}, "
        f"retain ×NLL {rec['retain_nll_ratio']:.3g}; held-out margins {held['margins']}; "
        f"{result['evaluations']} candidates in {result['seconds']['search']:.1f} s; warnings {result['warnings']}"
    )

    # the CLI: the same request is answered from storage; it prints the headline and the warnings
    env = {**os.environ, "ENGRAM_URL": collected.base_url}
    work = Path(os.environ.get("TMPDIR", "/tmp"))
    files = {}
    for split in ("forget", "retain"):
        files[split] = work / f"em-{split}-{os.getpid()}.jsonl"
        files[split].write_text("\n".join(json.dumps(p) for p in _pairs(demo_probes[split])) + "\n")
    cli = [sys.executable, "-m", "engram_client.cli", "calibrate", MODEL_ID, "--concept", "em-forget"]
    cli += ["--forget", str(files["forget"]), "--retain", str(files["retain"]), "--budget", str(BUDGET)]
    cli += ["--module-set", "all", "--module-set", "mlp", "--scaling", "uniform"]
    shown = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "forget exact" in shown.stdout and "search cost:" in shown.stdout, shown.stdout
    assert "held-out margins" in shown.stdout
    assert "[bold yellow]" not in shown.stdout, shown.stdout  # styled, not printed as a raw markup tag
    for warning in result["warnings"]:
        assert "warning:" in shown.stdout and warning[:40] in " ".join(shown.stdout.split())
