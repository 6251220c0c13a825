"""Calibrating the unlearning of a class through the HTTP API and the CLI, on a trained tiny ResNet.

A live ``engram-service serve`` registers the README's image-demo ResNet (engram_fixtures.image_demo:
the mini-CIFAR coloured digits, about half a minute of training on one thread), collects one concept
per class from its training images, and ``engram calibrate`` reads labelled image probes from JSONL
files (forget: the test images of class 0; retain: those of the other classes) with a quarter of them
held out. With no objective the calibration minimises the forget accuracy with the retain accuracy at
least 0.9 × the base's; the recommended variant must forget class 0 (accuracy ≤ 0.2) and keep that
bound on the held-out probes, which the search never saw. The held-out numbers are then checked
against ``evaluate`` of the built variant on those very probes (an independent path: the variant's
checkpoint loaded by the evaluation job, not the calibration's in-memory weights).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engram_fixtures.image_demo import build_image_demo
from engram_fixtures.live import LiveServer, running_server
from engram_fixtures.mini_cifar import FORGET_CLASS, NUM_CLASSES
from tests.helpers.api import register_model
from tests.helpers.classifier_api import class_universe, evaluated, read_records
from tests.helpers.cli import ok, run_cli

pytestmark = pytest.mark.slow

MODEL = "demo/digits"
CLASSES = [f"digit{k}" for k in range(NUM_CLASSES)]
TIMEOUT_S = 600.0
FORGOTTEN_CEILING = 0.2
HELD_OUT = 0.25
SPLIT_SEED = 0  # service.calibration.goal.SPLIT_SEED: the held-out split the service makes
TOL = 1e-6


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("calibrate-classifier-models") / "digits"
    build_image_demo(out)
    return out


@pytest.fixture(scope="module")
def server(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tmp_path_factory.mktemp("calibrate-classifier-api"), demo.parent, OMP_NUM_THREADS="1") as live:
        yield live


def _held_out(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probes the service holds out (service.calibration.goal.held_out_split, written again here)."""
    n_out = min(max(1, round(HELD_OUT * len(items))), len(items) - 1)
    out = set(random.Random(SPLIT_SEED).sample(range(len(items)), n_out))
    return [p for i, p in enumerate(items) if i in out]


def test_calibrating_a_class_forgets_it_within_the_retain_bound_on_held_out_probes(server: LiveServer, demo: Path) -> None:
    started = time.monotonic()
    client = server.client
    register_model(client, MODEL, f"file://{demo / 'model'}", existing_ok=True, timeout=TIMEOUT_S)
    classes = {name: read_records(demo / f"train-{k}.jsonl") for k, name in enumerate(CLASSES)}
    class_universe(client, MODEL, classes, TIMEOUT_S)
    forget, retain = demo / f"test-{FORGET_CLASS}.jsonl", demo / f"test-others-{FORGET_CLASS}.jsonl"
    arguments: list[str | Path] = [
        MODEL,
        "--concept",
        CLASSES[FORGET_CLASS],
        "--forget",
        forget,
        "--retain",
        retain,
        "--module-set",
        "all",
        "--scaling",
        "uniform",
        "--budget",
        "8",
        "--alpha-min",
        "0.25",
        "--alpha-max",
        "4",
        "--held-out-fraction",
        str(HELD_OUT),
    ]
    result = json.loads(ok(run_cli(server.base_url, "calibrate", "--json", *arguments, timeout=TIMEOUT_S)).stdout)
    assert result["objective"] == {"metric": "forget_accuracy", "sense": "minimize"}
    [bound] = result["constraints"]
    assert bound["metric"] == "retain_accuracy" and bound["min"] == pytest.approx(0.9 * bound["base"])
    best = result["recommended"]
    assert best is not None, result["note"]
    held = result["held_out"]
    [held_bound] = held["constraints"]
    print(  # noqa: T201  (the figures, for the report)
        f"\nbase forget/retain accuracy {result['base_metrics']['forget_accuracy']:.3f}/"
        f"{result['base_metrics']['retain_accuracy']:.3f}; recommended α={best['options']['alpha']:.3g}: searched "
        f"{best['metrics']['forget_accuracy']:.3f}/{best['metrics']['retain_accuracy']:.3f}, held out "
        f"{held['recommended']['forget_accuracy']:.3f}/{held['recommended']['retain_accuracy']:.3f} "
        f"(floor {held_bound['min']:.3f}); {result['evaluations']} candidates, {time.monotonic() - started:.0f} s"
    )
    assert result["base_metrics"]["forget_accuracy"] >= 0.8  # the class was learned
    assert best["metrics"]["forget_accuracy"] <= FORGOTTEN_CEILING
    assert held["feasible"] and held["candidate"] == best["candidate"]
    assert held["recommended"]["forget_accuracy"] <= FORGOTTEN_CEILING
    assert held["recommended"]["retain_accuracy"] >= held_bound["min"] == pytest.approx(0.9 * held_bound["base"])
    # the held-out numbers are evaluate's on the built variant, on those probes
    probes = {"forget": _held_out(read_records(forget)), "retain": _held_out(read_records(retain))}
    assert {k: len(v) for k, v in probes.items()} == held["probes"]
    job = evaluated(client, best["variant_id"], probes, TIMEOUT_S)
    sets = job["result"]["classifier"]["models"]
    for model, reported in (("variant", held["recommended"]), ("base", held["base"])):
        for split in ("forget", "retain"):
            for name in ("accuracy", "label_nll"):
                assert abs(sets[model]["sets"][split][name] - reported[f"{split}_{name}"]) <= TOL, (model, split, name)
    front = client.get(f"/calibrations/{result['calibration_id']}/front.png")
    assert front.status_code == 200 and front.content.startswith(b"\x89PNG")
    table = ok(run_cli(server.base_url, "calibrate", *arguments, timeout=TIMEOUT_S))  # the same request: stored
    assert "answered from storage" in table.stderr
    assert "objective: minimize forget_accuracy subject to retain_accuracy ≥" in table.stdout, table.stdout
    assert "image probes: ×NLL is the label's NLL ratio" in table.stdout
