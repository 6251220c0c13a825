"""Mini-TOFU: the paper's TOFU table on the demo facts, computed by the service's metric suite.

    python -m bench.tofu                    # 200 facts, forget 10 %, the demo's model: base and retain rows
    python -m bench.tofu --quick            # 40 facts, the tests' tiny model, 150 steps: a smoke run
    python -m bench.tofu --json out.json    # also every row's raw values, scores and left-out names

The protocol, as TOFU's: the base model is fine-tuned on every fact (``engram_fixtures.demo``'s
recipe: tokenizer, config, seed, steps); the retain model on the retain facts only, with the same
tokenizer, seed and steps; the forget probes are the forget facts with a paraphrased answer and
perturbed (wrong) answers (:func:`engram_fixtures.demo.tofu_answers`); the retain probes likewise;
the utility set is the retain facts of people none of whose facts is forgotten (TOFU's real-authors
and world-facts sets play this part); the holdout set is fresh facts no model saw (OpenUnlearning's
MIA AUCs, ``mia_*``; the privacy scores ``privacy_mia_*`` compare with the retain model instead).

Each model's statistics come from ``service.engine.tofu_scoring.tofu_statistics`` and its row from
``service.evaluation.tofu_metrics`` (raw values, then the scores against the retain and base
models). This is the skeleton of issue 26's bench: the rows of the base and retain models. Still
to add: Engram uniform α=0.6, Engram W-Norm, the calibrated Engram, and the GradDiff and NPO
baselines (a short training loop here), with the wall time and forward/backward passes of each.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engram_fixtures.demo import (
    DEFAULT_STEPS,
    make_facts,
    split_forget,
    tiny_llama_config,
    tofu_answers,
    train_on_facts,
    train_tokenizer,
)
from service.engine.evaluate import Probe
from service.engine.tofu_scoring import ProbeStatistics, TofuProbe, tofu_statistics
from service.evaluation import tofu_metrics as tm

THREADS = 2
Fact = tuple[str, str]

# (the paper's column heading, the value's name in the report)
COLUMNS = [
    ("Overall", "overall"),
    ("Mem", "memorization"),
    ("EM", "exact_memorization_rescaled"),
    ("ES", "extraction_strength_rescaled"),
    ("PP", "forget_Q_A_PARA_Prob_rescaled"),
    ("TR", "forget_truth_ratio_rescaled"),
    ("Util", "utility"),
    ("MU", "model_utility_rescaled"),
    ("Priv", "privacy"),
    ("S_loss", "privacy_mia_loss"),
    ("S_zlib", "privacy_mia_zlib"),
    ("S_mink", "privacy_mia_min_k"),
    ("S_mink++", "privacy_mia_min_k_plus_plus"),
    ("FQ", "forget_quality_log10"),
    ("privleak", "privleak"),
    ("rawEM", "exact_memorization"),
]


@dataclass(frozen=True)
class MiniTofu:
    """The probe sets of one mini-TOFU run."""

    forget: list[TofuProbe]
    retain: list[TofuProbe]
    utility: list[TofuProbe]
    holdout: list[TofuProbe]


def _person(prompt: str) -> str:
    # every make_facts question names its person (two words) after its last " was ", " of " or " does "
    for marker in (" was ", " of ", " does "):
        if marker in prompt:
            rest = prompt.rsplit(marker, 1)[1]
            return " ".join(rest.split()[:2]).rstrip("?")
    raise ValueError(f"no person in {prompt!r}")


def mini_tofu(facts: Sequence[Fact], forget: Sequence[Fact], seed: int, n_holdout: int) -> MiniTofu:
    """Probe sets with TOFU's fields from the demo's facts and its forget split."""
    extra = dict(zip(facts, tofu_answers(facts, seed), strict=True))
    forget_set = set(forget)
    forgotten_people = {_person(p) for p, _ in forget}

    def probe(fact: Fact) -> TofuProbe:
        para, wrong = extra[fact]
        return TofuProbe(Probe(*fact), para, wrong)

    retain = [f for f in facts if f not in forget_set]
    known = {w for p, c in facts for w in (p + c).split()}
    # fresh facts: a seed of its own, keeping only those whose words no trained fact uses
    fresh = [(p, c) for p, c in make_facts(4 * n_holdout, seed + 7919) if not set(_person(p).split() + c.split()) & known]
    return MiniTofu(
        forget=[probe(f) for f in forget],
        retain=[probe(f) for f in retain],
        utility=[probe(f) for f in retain if _person(f[0]) not in forgotten_people],
        holdout=[TofuProbe(Probe(*f)) for f in fresh[:n_holdout]],
    )


def model_report(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sets: MiniTofu) -> tm.ModelReport:
    """One model's raw TOFU values on the mini-TOFU sets."""

    def stats(probes: list[TofuProbe]) -> list[ProbeStatistics]:
        return tofu_statistics(model, tokenizer, probes)

    return tm.model_report(stats(sets.forget), stats(sets.retain), {"utility": stats(sets.utility)}, stats(sets.holdout))


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def print_table(rows: dict[str, tm.ModelReport], seconds: dict[str, float]) -> None:
    header = f"{'method':<10}" + "".join(f"{name:>10}" for name, _ in COLUMNS) + f"{'train s':>9}"
    print(header)
    for method, report in rows.items():
        cells = "".join(f"{_cell(report.values.get(key)):>10}" for _, key in COLUMNS)
        print(f"{method:<10}{cells}{seconds[method]:>9.1f}")
    for method, report in rows.items():
        if report.left_out:
            print(f"{method}: left out: " + "; ".join(f"{k} ({v})" for k, v in sorted(report.left_out.items())))


def train_model(
    tokenizer: PreTrainedTokenizerFast, facts: Sequence[Fact], seed: int, steps: int, small: bool
) -> LlamaForCausalLM:
    """``engram_fixtures.demo.build_demo``'s recipe (config, seed, steps) on ``facts``; ``small``: the
    tests' tiny shape (hidden 64, 2 layers), for a smoke run."""
    torch.manual_seed(seed)
    if small:
        config = tiny_llama_config(len(tokenizer), hidden=64, layers=2, intermediate=128, tokenizer=tokenizer)
    else:
        config = tiny_llama_config(len(tokenizer), tokenizer=tokenizer)
    model = LlamaForCausalLM(config)
    train_on_facts(model, tokenizer, list(facts), steps=steps, seed=seed)
    return model


def run(n_facts: int, seed: int, steps: int, small: bool) -> tuple[dict[str, tm.ModelReport], dict[str, float]]:
    """Train the base (every fact) and retain (retain facts only) models, score both, and return
    their rows and training times."""
    facts = make_facts(n_facts, seed)
    forget, retain = split_forget(facts, 0.1, seed)
    tokenizer = train_tokenizer([p + c for p, c in facts])  # one tokenizer for both, as build_demo's
    seconds: dict[str, float] = {}
    models = {}
    for name, train_facts in (("base", facts), ("retain", retain)):
        start = time.perf_counter()
        models[name] = train_model(tokenizer, train_facts, seed, steps, small)
        seconds[name] = time.perf_counter() - start
    sets = mini_tofu(facts, forget, seed, n_holdout=len(forget))
    raw = {name: model_report(model, tokenizer, sets) for name, model in models.items()}
    rows = {name: tm.tofu_scores(report, retain=raw["retain"], base=raw["base"]) for name, report in raw.items()}
    return rows, seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tofu", description=__doc__.splitlines()[0])
    parser.add_argument("--n-facts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--quick", action="store_true", help="40 facts, the tests' tiny model, 150 steps: a smoke run")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS})")
    parser.add_argument("--json", type=Path, default=None, help="write every row's values and left-out names here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n_facts, steps = (40, 150) if args.quick else (args.n_facts, args.steps)
    rows, seconds = run(n_facts, args.seed, steps, small=args.quick)
    print(f"mini-TOFU: {n_facts} facts, forget 10 %, seed {args.seed}, {steps} steps, {args.threads} threads")
    print_table(rows, seconds)
    if args.json is not None:
        payload = {m: {"values": r.values, "left_out": r.left_out, "train_s": seconds[m]} for m, r in rows.items()}
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
