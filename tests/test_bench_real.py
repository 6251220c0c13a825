"""bench.real and bench.robustness, quick plan, on the mini-TOFU demo's tiny Llama: the plumbing CI runs.

The real-model bench (``python -m bench.real --robustness``) needs SmolLM2-135M and a quarter of an hour;
here the same ``run`` builds every row (Engram through a live server: an α, W-Norm, the calibration's
recommendation; GradDiff and NPO) and attacks them, on the demo's facts: its forget facts are the
forgotten kind, retain facts the kept kinds and the general text. What is checked against an
independent computation (a plain teacher-forced argmax, ``tests.helpers.attacks``' gguf round trip
and fine-tuning loop): the base row's and an Engram row's exact matches, and the base under both
attacks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.real import CALIBRATED, GATED, QUICK, Report, run, table
from bench.real_data import BenchData, Record, Sizes, split_data
from bench.robustness import robustness_table
from tests.helpers.attacks import fine_tuned, q4_round_trip


def _records(path: Path) -> list[Record]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _exact(model: Any, tokenizer: Any, records: list[Record]) -> float:
    """Share of records whose answer tokens are each the model's argmax after the tokens before them."""
    hits = 0
    for record in records:
        prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
        answer = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0]
        hits += logits[len(prompt) - 1 : -1].argmax(-1).tolist() == answer
    return hits / len(records)


@pytest.fixture(scope="module")
def demo(mini_tofu_demo: Path) -> tuple[Path, BenchData]:
    folder = mini_tofu_demo / "demo"
    forget, retain = _records(folder / "forget.jsonl"), _records(folder / "retain.jsonl")
    data = split_data(forget, retain[:30], retain[30:40], retain[40:70], Sizes())
    return folder / "model", data


@pytest.fixture(scope="module")
def report(demo: tuple[Path, BenchData], tmp_path_factory: pytest.TempPathFactory) -> Report:
    torch.set_num_threads(1)
    model_dir, data = demo
    return run(model_dir, data, QUICK, tmp_path_factory.mktemp("bench-real"), robustness=True)


def test_every_row_is_built_scored_and_printed(report: Report) -> None:
    assert "failed" not in report.calibration, report.calibration
    assert "failed" not in report.notes["gated calibration"], report.notes["gated calibration"]
    expected = {"base", "Engram α=0.25", "Engram W-Norm", "GradDiff", "NPO"}
    # a calibration's row is there when it recommends a variant (on the demo it may find none feasible)
    assert expected <= set(report.rows) <= expected | {CALIBRATED, GATED}
    gated = report.notes["gated calibration"]
    if gated.get("attack_gate") is not None:  # the gate ran: its attacks are the plan's
        assert [c["attack"] for c in gated["attack_gate"]["constraints"]] == ["quantize:Q4_1", "relearn"]
    else:  # no candidate reached it: nothing recommended, and the note says why
        assert gated["recommended"] is None and gated["note"], gated
    assert (GATED in report.rows) == (gated["recommended"] is not None)
    assert report.rows["base"]["perplexity"] == 1.0
    rendered = table(report)
    for name in report.rows:
        assert f"| {name} |" in rendered
    for row in report.rows.values():
        assert all(0.0 <= row[column] <= 1.0 for column in ("forget data", "forget held", "kept data", "unseen kind"))


def test_rows_equal_a_plain_argmax_on_their_checkpoints(report: Report, demo: tuple[Path, BenchData]) -> None:
    model_dir, data = demo
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for name in ("base", "Engram α=0.25"):
        model = AutoModelForCausalLM.from_pretrained(report.built[name].folder).eval()
        for column, field in (("forget data", "forget"), ("kept held", "held_kept")):
            assert report.rows[name][column] == _exact(model, tokenizer, getattr(data, field)), (name, column)
    assert report.rows["base"]["forget data"] >= 0.9  # the demo's model knows its facts: something to forget


def test_the_base_under_attack_equals_an_independent_round_trip_and_loop(
    report: Report, demo: tuple[Path, BenchData]
) -> None:
    model_dir, data = demo
    assert report.robustness is not None
    attacked = report.robustness["base"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rounded = q4_round_trip(base).eval()
    assert attacked["Q4_1:forget data"] == _exact(rounded, tokenizer, data.forget)
    assert attacked["Q4_1:forget held"] == _exact(rounded, tokenizer, data.held_forget)
    half = len(data.forget) // 2
    tuned = fine_tuned(base, tokenizer, data.forget[:half], steps=QUICK.relearn_steps, lr=QUICK.relearn_lr, seed=0)
    assert attacked["relearn:after"] == _exact(tuned, tokenizer, [*data.forget[half:], *data.held_forget])
    rendered = robustness_table(report.robustness, QUICK)
    assert set(report.robustness) == {"base", "Engram α=0.25", "GradDiff", "NPO"} | ({CALIBRATED, GATED} & set(report.rows))
    assert all(rendered.count(f"| {name} |") == 3 for name in report.robustness)  # the Q4_1, relearn, rephrase tables
    # the demo's tokenizer has no chat template: the rephrase columns say so ("-"), they are not guessed
    assert all(math.isnan(row["chat:forget data"]) for row in report.robustness.values())
