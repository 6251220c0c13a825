"""Calibration on mini-TOFU, judged on facts it never saw (issue 16's bar).

A tiny Llama memorised 200 facts; the 20 forget facts are the concept removed, the 180 others the
reference. The facts are split: the calibration's probes are 10 forget and 60 retain facts, and the
other 10 forget and 120 retain facts are held out to judge it. Through the live API (embedded mode):

* ``POST /models/{id}/calibrate`` with ``max_retain_nll_ratio`` 2 and a budget of 32 evaluations
  finds a recommended variant. On the probes both were chosen on, its forget NLL ratio is at least
  that of the best point of the uniform-α grid (α = 0.05 … 1 by 0.05) × {all layers, Q/K+Gate}
  (40 evaluations, more than the search used), less the search's 1% bracket. On the held-out facts
  its retain NLL ratio is within 25% of the constraint and its forget NLL ratio within
  ``HELD_OUT_FORGET_MARGIN`` of the grid's best: two choices compared on facts neither was chosen
  on differ by noise, so that claim carries a margin (see the constant);
* the candidate's figures are the built variant's (``POST /variants/{id}/evaluate`` on the same
  probes gives the same NLLs): the in-memory evaluation measures the artifact users download;
* the same request again is answered from storage (200, the same job); the front renders as a PNG;
  ``engram calibrate`` prints the table.

The grid is evaluated here, independently of the service's search: from the α = 1 variants of both
module sets (downloaded), ``W(α) = W + α·(W₁ − W)`` (uniform scaling is linear in α).

Run ``pytest tests/e2e/test_calibrate_tofu.py -s`` to see the figures.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.cache import copy_entry
from engram_fixtures.demo import read_probes, tofu_answers, tofu_retain_model
from engram_fixtures.live import REPO_ROOT, LiveServer, download_variant, wait_for_job
from engram_fixtures.models import interpolated
from service.engine.evaluate import TextProbe, answer_nll
from tests.e2e.tofu import post_concept, probe_metrics
from tests.helpers.api import register_model

MODEL_ID = "demo/calibrate-tofu"
LIMIT = 2.0  # max_retain_nll_ratio
HELD_OUT_SLACK = 1.25  # the issue: the constraint met on held-out retain facts within 25%
BUDGET = 32
GRID_ALPHAS = [round(0.05 * k, 2) for k in range(1, 21)]  # the paper's hand grid
GRID_SETS = ("all", "qk_gate")
SPLIT_SEED = 3
# On the calibration probes the search's choice is the grid's best or better, but for its fine
# bracket (the best feasible α within 1% of the crossing, log-interpolated): near the crossing the
# forget ratio grows as about α^2.5 here, so 1% of α is 2.5% of forget ratio; 5% allowed. Measured
# 2026-11-29 (the one-thread fixture; CI's figures the same to every digit): the search converged
# in 29 evaluations at Q/K+Gate uniform α 0.756, ×29.9, against the grid's α 0.75, ×29.3. A search
# that ran out of budget two steps short of that crossing (α 0.702, ×26.3) failed here.
CALIBRATION_FORGET_MARGIN = 0.95
# On held-out facts the two choices are compared on facts neither saw: both are near the same α of
# the same arm, and which one comes out ahead is noise (measured as above: held-out forget ×4.85
# against the grid's ×4.73; the search stopped at α 0.702 gave ×3.92, 0.83 of it). The fixture
# trains with one thread, so these figures repeat on a machine; the margin covers another
# machine's float sums.
HELD_OUT_FORGET_MARGIN = 0.75


def _pairs(probes: list[TextProbe]) -> list[dict[str, str]]:
    return [{"prompt": p.prompt, "completion": p.completion} for p in probes]


@pytest.fixture(scope="module")
def probes(mini_tofu_demo: Path) -> dict[str, list[TextProbe]]:
    """Calibration probes and held-out facts, disjoint: 10 + 10 forget, 60 + 120 retain."""
    demo = mini_tofu_demo / "demo"
    forget, retain = read_probes(demo / "forget.jsonl"), read_probes(demo / "retain.jsonl")
    rng = random.Random(SPLIT_SEED)
    forget, retain = rng.sample(forget, len(forget)), rng.sample(retain, len(retain))
    half = len(forget) // 2
    return {
        "all_forget": forget,
        "all_retain": retain,
        "forget": forget[:half],
        "retain": retain[:60],
        "held_forget": forget[half:],
        "held_retain": retain[60:],
    }


@pytest.fixture(scope="module")
def collected(tofu_server: LiveServer, mini_tofu_demo: Path, probes: dict[str, list[TextProbe]]) -> LiveServer:
    """The demo model registered; every forget fact the target, every retain fact the reference."""
    client = tofu_server.client
    source = f"file://{mini_tofu_demo / 'demo' / 'model'}"
    register_model(client, MODEL_ID, source)
    for name, role, items in (
        ("cal-forget", "target", probes["all_forget"]),
        ("cal-retain", "reference", probes["all_retain"]),
    ):
        job = wait_for_job(client, post_concept(client, MODEL_ID, name, role, items), timeout=300)
        assert job["status"] == "succeeded", job
    return tofu_server


def calibration_body(probes: dict[str, list[TextProbe]]) -> dict[str, Any]:
    return {
        "concepts": ["cal-forget"],
        "forget": _pairs(probes["forget"]),
        "retain": _pairs(probes["retain"]),
        "max_retain_nll_ratio": LIMIT,
        "budget": BUDGET,
    }


def unlearn_at_one(client: httpx.Client, modules: list[str] | None, target: Path) -> Path:
    """The α = 1 uniform variant of a module set, downloaded."""
    body: dict[str, Any] = {"concepts": ["cal-forget"], "alpha": 1.0}
    if modules is not None:
        body["modules"] = modules
    submitted = client.post(f"/models/{MODEL_ID}/unlearn", json=body)
    assert submitted.status_code in (200, 202), submitted.text
    if submitted.status_code == 202:
        assert wait_for_job(client, submitted.json()["job"]["job_id"], timeout=300)["status"] == "succeeded"
    variant = client.get(f"/variants/{submitted.json()['variant']['variant_id']}").json()
    return download_variant(client, variant, target)


def mean_nll(model: torch.nn.Module, tokenizer: Any, items: list[TextProbe]) -> float:
    """Mean answer NLL (what the constraint and the objective read; no greedy decoding)."""
    values = answer_nll(model, tokenizer, items)
    return sum(values) / len(values)


def ratios(metrics: dict[str, dict[str, float]], base: dict[str, dict[str, float]]) -> dict[str, float]:
    return {split: metrics[split]["mean_nll"] / base[split]["mean_nll"] for split in metrics}


def test_calibration_meets_the_constraint_on_held_out_facts_and_beats_the_grid(
    collected: LiveServer, mini_tofu_demo: Path, probes: dict[str, list[TextProbe]], tmp_path: Path
) -> None:
    client, model_dir = collected.client, mini_tofu_demo / "demo" / "model"
    body = calibration_body(probes)
    submitted = client.post(f"/models/{MODEL_ID}/calibrate", json=body)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(client, submitted.json()["job"]["job_id"], timeout=900)
    assert job["status"] == "succeeded", job
    result = job["result"]
    assert job["kind"] == "calibrate" and job["progress"]["unit"] == "candidates"
    assert job["progress"]["done"] == job["progress"]["total"] == result["evaluations"]
    assert result["evaluations"] <= BUDGET < len(GRID_ALPHAS) * len(GRID_SETS)
    assert len(result["candidates"]) == result["evaluations"]
    assert set(result["pareto_front"]) == {c["index"] for c in result["candidates"] if c["pareto"]}
    recommended = result["recommended"]
    assert recommended is not None, result["note"]
    chosen = result["candidates"][recommended["candidate"]]
    assert chosen["feasible"] and chosen["retain"]["nll_ratio"] <= LIMIT
    assert chosen["forget"]["nll_ratio"] == max(c["forget"]["nll_ratio"] for c in result["candidates"] if c["feasible"])

    # The same request: answered from storage by the same job.
    again = client.post(f"/models/{MODEL_ID}/calibrate", json=body)
    assert again.status_code == 200, again.text
    assert again.json()["calibration_id"] == submitted.json()["calibration_id"]
    assert again.json()["job"]["job_id"] == job["job_id"]
    view = client.get(f"/calibrations/{submitted.json()['calibration_id']}").json()
    assert view["status"] == "succeeded" and view["result"]["recommended"] == recommended

    # The front renders.
    png = client.get(result["front_png"])
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(png.content))
    image.load()
    assert image.size == (900, 620)

    # The candidate's numbers are the built variant's.
    variant = client.get(f"/variants/{recommended['variant_id']}").json()
    assert variant["status"] == "ready" and variant["format"] == "checkpoint"
    assert variant["alpha"] == recommended["options"]["alpha"]
    assert variant["scaling"] == recommended["options"]["scaling"]
    assert variant["modules"] == recommended["options"]["modules"]
    scored = client.post(
        f"/variants/{variant['variant_id']}/evaluate?wait=60", json={"forget": body["forget"], "retain": body["retain"]}
    )
    assert scored.status_code == 200, scored.text
    summary = scored.json()["result"]["summary"]
    for split in ("forget", "retain"):
        assert summary["variant"][split]["mean_nll"] == pytest.approx(chosen[split]["mean_nll"], rel=1e-5)
        assert summary["variant"][split]["exact_match"] == chosen[split]["exact_match"]
        assert summary["base"][split]["mean_nll"] == pytest.approx(result["base"][split]["mean_nll"], rel=1e-6)

    # Held-out facts: the recommended variant as downloaded, against the grid chosen on the same probes.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    held = {"forget": probes["held_forget"], "retain": probes["held_retain"]}
    calib = {"forget": probes["forget"], "retain": probes["retain"]}
    base_held = {split: probe_metrics(base, tokenizer, items) for split, items in held.items()}
    edited = AutoModelForCausalLM.from_pretrained(download_variant(client, variant, tmp_path / "recommended")).eval()
    ours = ratios({split: probe_metrics(edited, tokenizer, items) for split, items in held.items()}, base_held)

    qk_gate = next(c["options"]["modules"] for c in result["candidates"] if c["options"]["module_set"] == "qk_gate")
    work = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    base_nll = {split: mean_nll(base, tokenizer, items) for split, items in calib.items()}
    grid: list[dict[str, Any]] = []  # chosen on the calibration probes by answer NLL, as the search chooses
    at_one = {}
    for module_set, modules in (("all", None), ("qk_gate", qk_gate)):
        at_one[module_set] = AutoModelForCausalLM.from_pretrained(unlearn_at_one(client, modules, tmp_path / module_set))
        for alpha in GRID_ALPHAS:
            model = interpolated(base, at_one[module_set], alpha, work)
            on_calib = {split: mean_nll(model, tokenizer, items) / base_nll[split] for split, items in calib.items()}
            grid.append({"module_set": module_set, "alpha": alpha, "calib": on_calib})
    feasible = [point for point in grid if point["calib"]["retain"] <= LIMIT]
    assert feasible, "no grid point meets the constraint"
    grid_best = max(feasible, key=lambda point: point["calib"]["forget"])
    model = interpolated(base, at_one[grid_best["module_set"]], grid_best["alpha"], work)
    grid_best["held"] = ratios({split: probe_metrics(model, tokenizer, items) for split, items in held.items()}, base_held)

    figures = {
        "evaluations": {"search": result["evaluations"], "grid": len(GRID_ALPHAS) * len(GRID_SETS)},
        "recommended": {**recommended["options"], "calibration": {"forget": chosen["forget"]["nll_ratio"],
                        "retain": chosen["retain"]["nll_ratio"]}, "held_out": ours},
        "grid_best": grid_best,
        "pruned_arms": result["pruned_arms"],
        "seconds": result["seconds"],
    }  # fmt: skip
    print("\ncalibration on mini-TOFU:\n" + json.dumps(figures, indent=1))  # noqa: T201 - the note's figures
    assert chosen["forget"]["nll_ratio"] >= CALIBRATION_FORGET_MARGIN * grid_best["calib"]["forget"], figures
    assert ours["retain"] <= HELD_OUT_SLACK * LIMIT, figures
    assert ours["forget"] >= HELD_OUT_FORGET_MARGIN * grid_best["held"]["forget"], figures

    # The CLI shows the table (answered from storage: the same request).
    for split in ("forget", "retain"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in body[split]))
    env = {**os.environ, "ENGRAM_URL": collected.base_url, "COLUMNS": "200"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "engram_client.cli", "calibrate", MODEL_ID, "-c", "cal-forget",
               "--forget", str(tmp_path / "forget.jsonl"), "--retain", str(tmp_path / "retain.jsonl"),
               "--max-retain-nll-ratio", str(LIMIT), "--budget", str(BUDGET),
               "--png", str(tmp_path / "front.png")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    print(done.stdout)  # noqa: T201 - the table, as users see it
    assert done.returncode == 0, done.stderr
    assert "forget ×NLL" in done.stdout and "retain ×NLL" in done.stdout
    assert f"variant {recommended['variant_id']}" in done.stdout
    assert len([line for line in done.stdout.splitlines() if "★" in line and "recommended" not in line]) == 1
    assert "answered from storage" in done.stderr
    assert (tmp_path / "front.png").read_bytes() == png.content


# ---------------------------------------------------------------- an objective: Overall under a Utility floor (issue 26)

RETAIN_MODEL_ID = "demo/calibrate-tofu-retain"
UTILITY_FLOOR = 0.9  # model_utility at least this times the base's
GOAL_BUDGET = 14
# The held-out claim is the service's own check (held_out.feasible: the bound resolved with the
# base's model_utility on the held-out probes); the test prints the margin it was met by. The search
# puts its best candidate on the floor's boundary (Privacy is ~0 for every feasible candidate on this
# tiny model, so Overall barely moves), where the held-out half's utility is that boundary plus
# sampling noise (measured 2026-11-27: α 0.693 all/uniform, held-out 0.8812 against a floor of
# 0.8761, ×1.006); so the service validates the choice on the held-out probes, rejecting up to three
# better-ranked candidates that miss the floor there, and this asserts that it did.


@pytest.fixture(scope="module")
def retain_model(mini_tofu_demo: Path) -> Path:
    """TOFU's retain model: the demo's recipe (config, seed, steps, one thread) on the retain facts
    only, with the demo model's tokenizer, beside it under the model root."""
    return copy_entry(tofu_retain_model(), mini_tofu_demo / "retain-model")  # trained once per fixture cache


def _tofu_pairs(probes: list[TextProbe]) -> list[dict[str, Any]]:
    """The probes with TOFU's extra answers (engram_fixtures.demo.tofu_answers, seed 0)."""
    extra = tofu_answers([(p.prompt or "", p.completion or "") for p in probes], 0)
    return [
        {"prompt": p.prompt, "completion": p.completion, "paraphrased_answer": para, "perturbed_answers": list(wrong)}
        for p, (para, wrong) in zip(probes, extra, strict=True)
    ]


def test_a_calibration_maximising_overall_under_a_utility_floor_meets_it_on_held_out_probes(
    collected: LiveServer, retain_model: Path, probes: dict[str, list[TextProbe]]
) -> None:
    client = collected.client
    register_model(client, RETAIN_MODEL_ID, f"file://{retain_model}")
    body = {
        "concepts": ["cal-forget"],
        "forget": _tofu_pairs(probes["all_forget"]),
        "retain": _tofu_pairs(probes["all_retain"][:60]),
        "utility": {"others": _tofu_pairs(probes["all_retain"][60:100])},
        "objective": {"maximize": "overall"},
        "constraints": [{"metric": "model_utility", "min_ratio_to_base": UTILITY_FLOOR}],
        "retain_model": RETAIN_MODEL_ID,
        "held_out_fraction": 0.5,
        "module_sets": ["all"],
        "budget": GOAL_BUDGET,
    }
    submitted = client.post(f"/models/{MODEL_ID}/calibrate", json=body)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(client, submitted.json()["job"]["job_id"], timeout=1800)
    assert job["status"] == "succeeded", job.get("error")
    result = job["result"]
    assert result["evaluations"] <= GOAL_BUDGET and result["objective"] == {"metric": "overall", "sense": "maximize"}
    [floor] = result["constraints"]
    assert floor["min"] == pytest.approx(UTILITY_FLOOR * result["base_metrics"]["model_utility"])
    recommended = result["recommended"]
    assert recommended is not None, result["note"]
    feasible = [c for c in result["candidates"] if c["feasible"]]
    assert all(c["metrics"]["model_utility"] >= floor["min"] for c in feasible)
    held = result["held_out"]
    # The held-out probes validate the choice: the best candidates that missed the floor there are
    # rejected, and the recommendation is the best of the rest.
    assert recommended["candidate"] == held["candidate"] and recommended["candidate"] not in held["rejected"]
    kept = [c for c in feasible if c["index"] not in held["rejected"]]
    assert recommended["metrics"]["overall"] == max(c["metrics"]["overall"] for c in kept)

    assert held["probes"] == {"forget": 10, "retain": 30, "others": 20}
    held_floor = held["constraints"][0]["min"]
    assert held_floor == pytest.approx(UTILITY_FLOOR * held["base"]["model_utility"])
    margin = held["recommended"]["model_utility"] / held_floor
    figures = {
        "recommended": recommended["options"],
        "searched": {k: recommended["metrics"][k] for k in ("overall", "model_utility", "privacy", "memorization")},
        "held_out": {k: held["recommended"][k] for k in ("overall", "model_utility", "privacy", "memorization")},
        "held_out_floor": held_floor,
        "held_out_margin": margin,
        "evaluations": result["evaluations"],
        "seconds": result["seconds"],
    }
    print("\nOverall under a utility floor on mini-TOFU:\n" + json.dumps(figures, indent=1))  # noqa: T201
    assert held["feasible"] and margin >= 1.0, figures
    png = client.get(result["front_png"], params={"x": "model_utility", "y": "overall"})
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
