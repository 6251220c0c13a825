"""bench.tofu_robustness's row builder on the mini-TOFU demo: every column, checked where a reference exists.

The bench's rows come from ``bench.real.run`` (``tests/test_bench_real.py`` runs it on this demo);
here :func:`bench.tofu_robustness.tofu_rows` scores two models with TOFU's suite before and after each
attack, through the evaluation job's ``run_attacks``:

* the retain model as the "variant": Forget Quality compares a model's truth ratios with the retain
  model's, so the retain model against itself is a KS test of one sample with itself (p = 1, log10 0),
  unattacked and after each attack (both copies are attacked alike, deterministically);
* the base model: its forget exact match after Q4_1 equals an independent gguf round trip
  (``tests.helpers.attacks``) scored by a plain greedy match; relearning recovers nothing it forgot
  (it forgot nothing: undefined, NaN); it knows its forget facts, so its Forget Quality is below the
  retain model's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.tofu_robustness import QUICK, TofuSetup, tofu_rows, tofu_setup, tofu_table
from tests.helpers.attacks import q4_round_trip, summary

COLUMNS = [
    "forget_exact_match",
    "forget_quality_log10",
    "model_utility",
    *(f"{a}:{m}" for a in ("quantize", "relearn") for m in ("forget_exact_match", "forget_quality_log10", "model_utility")),
    "rephrase:forget_exact_match",
]


@pytest.fixture(scope="module")
def setup(mini_tofu_demo: Path) -> TofuSetup:
    from engram_fixtures.demo import tofu_retain_model

    torch.set_num_threads(1)
    return tofu_setup(mini_tofu_demo / "demo", tofu_retain_model())


@pytest.fixture(scope="module")
def models(setup: TofuSetup) -> tuple[Any, Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(setup.model_dir)
    base = AutoModelForCausalLM.from_pretrained(setup.model_dir).eval()
    retain = AutoModelForCausalLM.from_pretrained(setup.retain_dir).eval()
    return tokenizer, base, retain


@pytest.fixture(scope="module")
def rows(setup: TofuSetup, models: tuple[Any, Any, Any]) -> dict[str, dict[str, float]]:
    tokenizer, base, retain = models
    return tofu_rows({"base": base, "retain model": retain}, base, retain, tokenizer, setup, QUICK)


def test_the_retain_model_against_itself_has_forget_quality_one_before_and_after_each_attack(
    rows: dict[str, dict[str, float]],
) -> None:
    row = rows["retain model"]
    assert all(key in row for key in COLUMNS), sorted(row)
    for key in ("forget_quality_log10", "quantize:forget_quality_log10", "relearn:forget_quality_log10"):
        assert row[key] == pytest.approx(0.0, abs=1e-9), key
    assert 0.0 < row["model_utility"] <= 1.0
    rendered = tofu_table(rows, QUICK)
    assert "| retain model | " in rendered and "| base | " in rendered and rendered.count("\n") == 3


def test_the_base_row_equals_independent_computations(
    setup: TofuSetup, models: tuple[Any, Any, Any], rows: dict[str, dict[str, float]]
) -> None:
    tokenizer, base, _ = models
    row = rows["base"]
    forget = [{"prompt": p.probe.prompt, "completion": p.probe.completion} for p in setup.sets.forget]
    assert row["forget_exact_match"] == summary(base, tokenizer, forget)["exact_match"] >= 0.9
    rounded = q4_round_trip(base).eval()
    assert row["quantize:forget_exact_match"] == summary(rounded, tokenizer, forget)["exact_match"]
    assert math.isnan(row["relearn:recovered_fraction"])  # nothing forgotten, nothing to recover
    assert row["forget_quality_log10"] < -1.0  # it knows the facts the retain model never saw
    paraphrased = [{"prompt": p.probe.prompt, "completion": p.paraphrased_answer or ""} for p in setup.sets.forget]
    assert row["rephrase:forget_exact_match"] == summary(base, tokenizer, paraphrased)["exact_match"]
