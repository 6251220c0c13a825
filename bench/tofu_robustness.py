"""Does the forgetting hold on mini-TOFU? The robustness table with TOFU's Forget Quality and model utility.

    python -m bench.tofu_robustness            # α grid 0.25-2, calibrations of budget 10
    python -m bench.tofu_robustness --quick    # one α, calibrations of budget 6
    python -m bench.tofu_robustness --json out.json

The model is the tests' mini-TOFU demo (:func:`engram_fixtures.demo.mini_tofu`: a tiny Llama that
memorised 200 synthetic facts, 20 of them the forget set) and its TOFU retain model
(:func:`engram_fixtures.demo.tofu_retain_model`: the same recipe on the 180 retain facts only),
both from the fixture cache. The rows are :func:`bench.real.run`'s, on the demo's facts: base, Engram
at each α of the grid (uniform), W-Norm, the default-objective calibration's recommendation, the same
calibration under the attack gate (``attack_constraints``), GradDiff and NPO (the tiny models'
settings of :mod:`bench.gradient_baselines`), all built through the service's HTTP API or loops, and
:mod:`bench.robustness`' exact-match tables (Q4_1, relearn, rephrase).

On top, TOFU's suite (OpenUnlearning's names, :mod:`service.evaluation.tofu_metrics`): Forget Quality
(the KS test's p-value of the model's truth ratios on the 20 forget facts against the retain
model's; log10 here, higher is closer to never having seen them) and model utility (the harmonic mean
over the retain and utility sets), unattacked and after each attack, computed by the evaluation job's
own function :func:`service.evaluation.attacks.run_attacks` with the base, the retain model and the
row as its three models (an attacked model is scored against the attacked retain and base, as
``evaluate`` with ``attacks`` and ``metrics`` reports):

* ``quantize:Q4_1``: every TOFU set scored on the round-tripped copies;
* ``relearn``: the first half of the 20 forget facts learned back (the plan's steps and lr); Forget
  Quality on the other half (so the retain model's truth ratios are on the same 10);
* ``rephrase:paraphrased``: the forget facts asked with their paraphrased answer (TOFU's
  ``paraphrased_answer``); the suite is not computed on rephrased probes (``evaluate`` leaves it out
  too), so the column is the forget exact match on the paraphrases.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from api_schemas.attacks import QuantizeAttack, RelearnAttack, RephraseAttack
from api_schemas.evaluation import Split
from bench.gradient_baselines import Settings
from bench.real import CALIBRATED, GATED, Plan, Report, run
from bench.real_data import BenchData, Record, Sizes, split_data
from bench.tofu import MiniTofu, mini_tofu, model_report
from service.engine.attacks.rephrase import with_answer
from service.engine.evaluate import TextProbe, encoded
from service.engine.probe_bound import probe_bound
from service.evaluation.attacks import (
    AttackContext,
    PreparedAttack,
    prepare_relearn,
    run_attacks,
    summaries,
)
from service.evaluation.tofu_metrics import tofu_scores

# Relearning's lr: the demo trained at 3e-3; ten steps at 1e-3 cost the base itself a third of the
# forget facts it did not train on (measured), and a large model's 2e-5 barely moves a tiny one.
# GradDiff and NPO: the tiny models' defaults (10 epochs at 5e-4).
RELEARN_LR = 3e-4
_GATE = (
    {"attack": {"kind": "quantize", "type": "Q4_1"}, "metric": "forget_exact_match", "max": 0.2},
    {"attack": {"kind": "relearn", "steps": 10, "lr": RELEARN_LR}, "metric": "recovered_fraction", "max": 0.3},
)
PLAN = Plan(alphas=(0.25, 0.5, 1.0, 2.0), budget=10, baseline=Settings(), relearn_lr=RELEARN_LR, gate=_GATE)
QUICK = Plan(alphas=(0.5,), budget=6, baseline=Settings(), relearn_lr=RELEARN_LR, gate=_GATE)
TOFU_METRICS = ["forget_quality_log10", "forget_quality", "model_utility"]


@dataclass
class TofuSetup:
    """The demo's folders, its facts as the bench's splits and as TOFU probe sets."""

    model_dir: Path
    retain_dir: Path
    data: BenchData
    sets: MiniTofu


def _records(path: Path) -> list[Record]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tofu_setup(demo_root: Path, retain_dir: Path) -> TofuSetup:
    """The demo's splits: the 20 forget facts the forgotten kind (70% in the target concept), the
    retain facts the kept kind (60), a kind no concept names (30) and the "paragraphs" (90: the
    general-text reference, the calibration's utility, held-out text for perplexity); and TOFU's sets
    (:func:`bench.tofu.mini_tofu`: paraphrased and perturbed answers, utility and holdout facts)."""
    forget, retain = _records(demo_root / "forget.jsonl"), _records(demo_root / "retain.jsonl")
    data = split_data(forget, retain[:60], retain[60:90], retain[90:], Sizes())
    pairs = [(r["prompt"], r["completion"]) for r in [*forget, *retain]]
    sets = mini_tofu(pairs, pairs[: len(forget)], seed=0, n_holdout=len(forget))
    return TofuSetup(demo_root / "model", retain_dir, data, sets)


def _load(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


class _NoProgress:
    def advance(self, amount: int = 1) -> None:
        """The bench reports per row, not per probe."""


def prepared_attacks(tokenizer: Any, model: Any, setup: TofuSetup, plan: Plan) -> list[PreparedAttack]:
    """Q4_1, relearn and the paraphrased rephrasing, prepared as the evaluation job prepares them."""
    bound = probe_bound(tokenizer, model.config, 2048)
    sets = setup.sets
    tofu = {"forget": sets.forget, "retain": sets.retain, "utility": sets.utility, "holdout": sets.holdout}
    probes: dict[Split, list[TextProbe]] = {
        "forget": [encoded(tokenizer, p.probe, bound=bound) for p in sets.forget],
        "retain": [encoded(tokenizer, p.probe, bound=bound) for p in sets.retain],
    }
    relearn = RelearnAttack(kind="relearn", steps=plan.relearn_steps, lr=plan.relearn_lr)
    quantize = QuantizeAttack(kind="quantize", type=plan.quantization)  # type: ignore[arg-type]
    rephrase = RephraseAttack(kind="rephrase", form="paraphrased")
    paraphrased = [encoded(tokenizer, with_answer(p.probe, p.paraphrased_answer or ""), bound=bound) for p in sets.forget]
    return [
        PreparedAttack(f"quantize:{plan.quantization}", quantize, probes, tofu),
        prepare_relearn("relearn", relearn, tokenizer, probes, tofu, bound),
        PreparedAttack("rephrase:paraphrased", rephrase, {"forget": paraphrased, "retain": probes["retain"]}),
    ]


def tofu_rows(
    variants: dict[str, Any], base: Any, retain: Any, tokenizer: Any, setup: TofuSetup, plan: Plan
) -> dict[str, dict[str, float]]:
    """Each model's TOFU figures: unattacked (against the retain and base models) and after each attack,
    by the evaluation job's :func:`run_attacks` with the base, the retain model and the row as its
    three models (an attacked model scored against the attacked retain model and base, as the job)."""
    reports = {name: model_report(m, tokenizer, setup.sets) for name, m in (("base", base), ("retain", retain))}
    prepared = prepared_attacks(tokenizer, base, setup, plan)
    rows: dict[str, dict[str, float]] = {}
    for name, model in variants.items():
        models = {"base": lambda: base, "retain": lambda: retain, "variant": lambda m=model: m}  # type: ignore[misc]
        context = AttackContext(models, tokenizer, "tofu", batch_tokens=1 << 14, progress=_NoProgress())  # type: ignore[arg-type]
        scored = tofu_scores(model_report(model, tokenizer, setup.sets), reports["retain"], reports["base"]).values
        row = {key: float(scored.get(key, math.nan)) for key in TOFU_METRICS}
        unattacked = summaries(model, prepared[0].probes, context)  # every forget and retain fact, as sent
        row["forget_exact_match"], row["retain_exact_match"] = (unattacked[s].exact_match for s in ("forget", "retain"))
        for attack, report in run_attacks(prepared, context).items():
            prefix = attack.split(":")[0]
            row[f"{prefix}:forget_exact_match"] = report.summary["variant"]["forget"].exact_match
            row[f"{prefix}:retain_exact_match"] = report.summary["variant"]["retain"].exact_match
            values = report.tofu["variant"].values if report.tofu else {}
            row.update({f"{prefix}:{key}": _float(values.get(key)) for key in TOFU_METRICS})
            if isinstance(report.attack.get("steps"), int):  # relearn: NaN where nothing was forgotten
                row[f"{prefix}:recovered_fraction"] = _float(report.recovered_fraction)
        rows[name] = row
        print(f"[tofu] {name}: {row}", file=sys.stderr, flush=True)
    return rows


def _float(value: float | None) -> float:
    return math.nan if value is None else float(value)


def attacked_tofu_rows(report: Report, setup: TofuSetup, plan: Plan) -> dict[str, dict[str, float]]:
    """The TOFU figures of every row the robustness table attacks (base, the α grid, both calibrations,
    GradDiff, NPO), from the checkpoints :func:`bench.real.run` built."""
    tokenizer = AutoTokenizer.from_pretrained(setup.model_dir)
    base, retain = _load(setup.model_dir), _load(setup.retain_dir)
    chosen = ["base", *[f"Engram α={a:g}" for a in plan.alphas], CALIBRATED, GATED, "GradDiff", "NPO"]
    variants = {name: _load(report.built[name].folder) for name in chosen if name in report.built and name != "base"}
    started = time.perf_counter()
    rows = tofu_rows({"base": base, **variants}, base, retain, tokenizer, setup, plan)
    print(f"[tofu] {len(rows)} rows in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return rows


def _fq(value: float) -> str:
    return "-" if math.isnan(value) else ("−∞" if value == -math.inf else f"{value:.2f}")


def _num(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def tofu_table(rows: dict[str, dict[str, float]], plan: Plan) -> str:
    """Forget Quality (log10) and model utility before and after Q4_1 and relearning, with forget exact
    match; the forget exact match on the paraphrased answers."""
    q = plan.quantization
    head = [
        "model",
        "forget EM",
        "log10 FQ",
        "MU",
        f"{q}: forget EM",
        f"{q}: log10 FQ",
        f"{q}: MU",
        f"relearn {plan.relearn_steps} steps: forget EM (other half)",
        "relearn: log10 FQ (other half)",
        "relearn: MU",
        "recovered",
        "paraphrased: forget EM",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        cells = [
            _pct(r["forget_exact_match"]),
            _fq(r["forget_quality_log10"]),
            _num(r["model_utility"]),
            _pct(r["quantize:forget_exact_match"]),
            _fq(r["quantize:forget_quality_log10"]),
            _num(r["quantize:model_utility"]),
            _pct(r["relearn:forget_exact_match"]),
            _fq(r["relearn:forget_quality_log10"]),
            _num(r["relearn:model_utility"]),
            _pct(r.get("relearn:recovered_fraction", math.nan)),
            _pct(r["rephrase:forget_exact_match"]),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.real import describe, table
    from bench.robustness import robustness_table
    from engram_fixtures.cache import copy_entry
    from engram_fixtures.demo import mini_tofu as demo_fixture
    from engram_fixtures.demo import tofu_retain_model

    parser = argparse.ArgumentParser(prog="python -m bench.tofu_robustness", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one α, calibrations of budget 6")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="write every row's figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else PLAN
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-tofu-robust-") as scratch:
        work = Path(scratch)
        demo = copy_entry(demo_fixture(), work / "models" / "demo")  # the server registers from a folder it may write
        setup = tofu_setup(demo, tofu_retain_model())
        report = run(setup.model_dir, setup.data, plan, work, robustness=True)
        rows = attacked_tofu_rows(report, setup, plan)
    print(f"mini-TOFU demo (200 facts, 20 forgotten), {args.threads} threads, {'quick' if args.quick else 'full'} plan")
    print(f"plan: {json.dumps(asdict(plan), default=str)}")
    print(table(report))
    print(describe(report, plan))
    assert report.robustness is not None
    print(robustness_table(report.robustness, plan))
    print(tofu_table(rows, plan))
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": report.rows, "robustness": report.robustness, "tofu": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
