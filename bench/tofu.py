"""Mini-TOFU: the paper's TOFU table on the demo facts, computed by the service's metric suite.

    python -m bench.tofu                    # 200 facts, forget 10 %, the demo's model: the whole table
    python -m bench.tofu --quick            # 40 facts, the tests' tiny model, 150 steps: a smoke run
    python -m bench.tofu --json out.json    # also every row's raw values, scores and the calibration
    python -m bench.tofu --answer-pool 6    # answers shared across people (pooled_facts), as TOFU's

The protocol, as TOFU's: the base model is fine-tuned on every fact (``engram_fixtures.demo``'s
recipe: tokenizer, config, seed, steps); the retain model on the retain facts only, with the same
tokenizer, seed and steps; the forget probes are the forget facts with a paraphrased answer and
perturbed (wrong) answers (:func:`engram_fixtures.demo.tofu_answers`); the retain probes likewise;
the utility set is the retain facts of people none of whose facts is forgotten (TOFU's real-authors
and world-facts sets play this part); the holdout set is fresh facts no model saw (OpenUnlearning's
MIA AUCs, ``mia_*``; the privacy scores ``privacy_mia_*`` compare with the retain model instead).

With the demo's facts every answer is a distinct string of random syllables, so the retain model
has never seen a forget answer's word and scores it worse than a uniform guess: no edit that keeps
the retain facts makes the forget answers look like that, and Privacy is 0 within any Utility
floor (``python -m bench.tofu_sweep`` shows the AUCs along α). ``--answer-pool`` draws each
answer from a few per attribute shared by every person, so the retain model's forget loss is that
of not knowing which answer, as a model trained without TOFU's forget authors still finds their
answers' words plausible. A limit that remains: the tiny models never learn the paraphrased form
(``forget_Q_A_PARA_Prob`` ~1e-3 for base and retain alike), so its rescaled value is noise over
noise, often clipped to 1, and then Memorization, and Overall, is 0 for every unlearned row (the
gradient baselines' too; seen at seed 1 and at 200 facts).

The rows: the base and retain models; Engram at uniform α=0.6 and Engram W-Norm (``scaling``
``weight_norm`` at α=1: the per-layer strength rescaled to a maximum of 1), the paper's two
settings; the calibrated Engram (``calibrate`` maximising Overall under model_utility ≥ 0.9 × the
base's, on the same probes as the table, over {all, Q/K+Gate} × {uniform, W-Norm}); GradDiff and
NPO (:mod:`bench.gradient_baselines`). The Engram rows are built by the service itself, through
its HTTP API (a live server in embedded mode on a scratch store), and downloaded.

Each model's statistics come from ``service.engine.tofu_scoring.tofu_statistics`` and its row from
``service.evaluation.tofu_metrics`` (raw values, then the scores against the retain and base
models). What each row spent: wall time, and sequences through a forward and a backward pass
(training: steps × batch; Engram: one forward pass per fact to collect statistics, the edit itself
none; the calibration: each candidate's teacher-forced scoring on top, its greedy decoding for
ROUGE and exact match not counted).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from bench.gradient_baselines import unlearn
from engram_fixtures.demo import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_STEPS,
    make_facts,
    split_forget,
    tiny_llama_config,
    tofu_answers,
    train_on_facts,
    train_tokenizer,
)
from engram_fixtures.live import (
    download_variant,
    post_and_wait,
    start_server,
    stop_server,
    wait_concepts_ready,
    wait_for_job,
)
from service.engine.evaluate import TextProbe
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


def pooled_facts(n: int, seed: int, pool: int | None) -> list[Fact]:
    """:func:`engram_fixtures.demo.make_facts`' facts; with ``pool``, each answer replaced by one of
    the first ``pool`` answers of its attribute (its question unchanged), drawn with ``seed``.

    Why: the demo's answers are distinct random syllables, so a retain model has never seen a forget
    answer and scores it worse than a uniform guess (6.5 nats/token on a 512-token vocabulary at
    100 facts, 300 steps). TOFU's answers are ordinary words a model trained without them still
    finds plausible; with a pool, every forget answer is also another person's retain answer, and
    the retain model's forget loss is what not knowing *which* answer costs, as in TOFU. The
    facts, the forget split and the probes are otherwise those of ``make_facts``."""
    facts = make_facts(n, seed)
    if pool is None:
        return facts
    if pool < 2:
        raise ValueError(f"the answer pool needs at least 2 answers per attribute, got {pool}")
    rng = random.Random(f"pool-{seed}")
    by_kind: dict[str, list[str]] = {}
    for prompt, completion in facts:
        by_kind.setdefault(_kind(prompt), []).append(completion)
    pools = {kind: answers[:pool] for kind, answers in by_kind.items()}
    return [(prompt, rng.choice(pools[_kind(prompt)])) for prompt, _ in facts]


def _kind(prompt: str) -> str:
    # a make_facts question without its person: the attribute's template
    return prompt.replace(_person(prompt), "")


def mini_tofu(facts: Sequence[Fact], forget: Sequence[Fact], seed: int, n_holdout: int, pooled: bool = False) -> MiniTofu:
    """Probe sets with TOFU's fields from the demo's facts and its forget split (``pooled``: the
    facts' answers come from :func:`pooled_facts`' pool, and so do the holdout facts', about people
    no model saw: a non-member differs from a forget fact by the person only, as in TOFU)."""
    extra = dict(zip(facts, tofu_answers(facts, seed), strict=True))
    forget_set = set(forget)
    forgotten_people = {_person(p) for p, _ in forget}

    def probe(fact: Fact) -> TofuProbe:
        para, wrong = extra[fact]
        return TofuProbe(TextProbe(*fact), para, wrong)

    retain = [f for f in facts if f not in forget_set]
    known = {w for p, c in facts for w in (p + c).split()}
    # fresh facts: a seed of its own, keeping only those whose words no trained fact uses
    fresh = [(p, c) for p, c in make_facts(4 * n_holdout, seed + 7919) if not set(_person(p).split() + c.split()) & known]
    if pooled:
        answers: dict[str, list[str]] = {}
        for prompt, completion in facts:
            answers.setdefault(_kind(prompt), []).append(completion)
        rng = random.Random(f"holdout-{seed}")
        unseen = [p for p, _ in make_facts(4 * n_holdout, seed + 7919) if not set(_person(p).split()) & known]
        fresh = [(p, rng.choice(sorted(set(answers[_kind(p)])))) for p in unseen]
    return MiniTofu(
        forget=[probe(f) for f in forget],
        retain=[probe(f) for f in retain],
        utility=[probe(f) for f in retain if _person(f[0]) not in forgotten_people],
        holdout=[TofuProbe(TextProbe(*f)) for f in fresh[:n_holdout]],
    )


def model_report(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sets: MiniTofu) -> tm.ModelReport:
    """One model's raw TOFU values on the mini-TOFU sets."""

    def stats(probes: list[TofuProbe]) -> list[ProbeStatistics]:
        return tofu_statistics(model, tokenizer, probes)

    return tm.model_report(stats(sets.forget), stats(sets.retain), {"utility": stats(sets.utility)}, stats(sets.holdout))


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isfinite(value) and abs(value) >= 1e4:  # privleak when the retain AUC is 0 or 1: ±1e12
        return f"{value:.3g}"
    return f"{value:.4f}" if math.isfinite(value) else str(value)


@dataclass
class Cost:
    """What a row's method spent: wall time and sequences through forward and backward passes."""

    seconds: float
    forward: int
    backward: int
    note: str = ""


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


def _probe_json(probe: TofuProbe) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": probe.probe.prompt, "completion": probe.probe.completion}
    if probe.paraphrased_answer is not None:
        body["paraphrased_answer"] = probe.paraphrased_answer
    if probe.perturbed_answers is not None:
        body["perturbed_answers"] = list(probe.perturbed_answers)
    return body


def _sequences(probes: Sequence[TofuProbe]) -> int:
    """Teacher-forced sequences one TOFU scoring of ``probes`` runs (answer, paraphrase, wrong answers)."""
    return sum(1 + (p.paraphrased_answer is not None) + len(p.perturbed_answers or ()) for p in probes)


def _job(client: httpx.Client, response: httpx.Response, timeout: float = 1800) -> dict[str, Any]:
    assert response.status_code in (200, 202), response.text
    job = wait_for_job(client, response.json()["job"]["job_id"], timeout=timeout)
    assert job["status"] == "succeeded", job
    return job


def _variant(client: httpx.Client, body: dict[str, Any], target: Path) -> tuple[PreTrainedModel, float]:
    """An unlearn variant of the base model built through the API and downloaded; its build time."""
    started = time.perf_counter()
    response = client.post(f"/models/{BASE_ID}/unlearn", json=body)
    _job(client, response)
    seconds = time.perf_counter() - started
    return _download(client, response.json()["variant"]["variant_id"], target), seconds


def _download(client: httpx.Client, variant_id: str, target: Path) -> PreTrainedModel:
    variant = client.get(f"/variants/{variant_id}").json()
    folder = download_variant(client, variant, target)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


BASE_ID, RETAIN_ID = "bench/tofu-base", "bench/tofu-retain"


def engram_rows(
    models: dict[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerFast,
    sets: MiniTofu,
    work: Path,
    budget: int,
    search: dict[str, Any] | None = None,
) -> tuple[dict[str, PreTrainedModel], dict[str, Cost], dict[str, Any]]:
    """Engram α=0.6 (uniform), Engram W-Norm (weight_norm at α=1: the strength rescaled to max 1)
    and the calibrated Engram (maximise Overall under model_utility ≥ 0.9 of the base's), each
    built through the live API (embedded mode) and downloaded; what each spent; the calibration."""
    root = work / "models"
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    server = start_server(work / "store", root, work / "server.log")
    try:
        client = server.client
        for model_id, name in ((BASE_ID, "base"), (RETAIN_ID, "retain")):
            post_and_wait(client, "/models", {"model_id": model_id, "source": f"file://{root / name}"}, 600)
        started = time.perf_counter()
        for concept, role, probes in (("tofu-forget", "target", sets.forget), ("tofu-retain", "reference", sets.retain)):
            records = [{"prompt": p.probe.prompt, "completion": p.probe.completion} for p in probes]
            concept_body = {"name": concept, "role": role, "models": [BASE_ID], "records": records}
            assert client.post("/concepts", json=concept_body).status_code == 202
        wait_concepts_ready(client, ["tofu-forget", "tofu-retain"], BASE_ID, timeout=1800)
        collect_s = time.perf_counter() - started
        collect_fwd = len(sets.forget) + len(sets.retain)  # one forward pass per fact
        out: dict[str, PreTrainedModel] = {}
        costs: dict[str, Cost] = {}
        for row, body in (
            ("Engram a=.6", {"concepts": ["tofu-forget"], "alpha": 0.6}),
            ("Engram WN", {"concepts": ["tofu-forget"], "alpha": 1.0, "scaling": "weight_norm"}),
        ):
            out[row], seconds = _variant(client, body, work / row.replace(" ", "_").replace("=", ""))
            costs[row] = Cost(collect_s + seconds, collect_fwd, 0, f"collection {collect_s:.1f} s + build {seconds:.1f} s")
        request = {
            "concepts": ["tofu-forget"],
            "forget": [_probe_json(p) for p in sets.forget],
            "retain": [_probe_json(p) for p in sets.retain],
            "utility": {"utility": [_probe_json(p) for p in sets.utility]},
            "holdout": [_probe_json(p) for p in sets.holdout],
            "objective": {"maximize": "overall"},
            "constraints": [{"metric": "model_utility", "min_ratio_to_base": 0.9}],
            "retain_model": RETAIN_ID,
            "budget": budget,
            **(search or {}),  # the search space asked on the command line (module/layer sets, α range)
        }
        started = time.perf_counter()
        job = _job(client, client.post(f"/models/{BASE_ID}/calibrate", json=request), timeout=3600)
        calibrate_s = time.perf_counter() - started
        result = job["result"]
        per_candidate = len(sets.forget) + len(sets.retain)  # the NLL scoring
        per_candidate += sum(_sequences(s) for s in (sets.forget, sets.retain, sets.utility, sets.holdout))
        evaluated = result["evaluations"] + 2  # the candidates, the base and the retain model
        if result["recommended"] is not None:
            out["Engram cal"] = _download(client, result["recommended"]["variant_id"], work / "calibrated")
            costs["Engram cal"] = Cost(
                collect_s + calibrate_s,
                collect_fwd + evaluated * per_candidate,
                0,
                f"collection {collect_s:.1f} s + calibration {calibrate_s:.1f} s ({result['evaluations']} candidates)",
            )
        return out, costs, result
    finally:
        stop_server(server)


def run(
    n_facts: int,
    seed: int,
    steps: int,
    small: bool,
    budget: int,
    work: Path,
    pool: int | None = None,
    search: dict[str, Any] | None = None,
) -> tuple[dict[str, tm.ModelReport], dict[str, Cost], dict[str, Any]]:
    """Train the base (every fact) and retain (retain facts only) models, unlearn with Engram (three
    ways) and the two gradient baselines, score every model, and return the rows and their costs
    (``pool``: :func:`pooled_facts`' answers; ``search``: calibration options over the defaults)."""
    facts = pooled_facts(n_facts, seed, pool)
    forget, retain = split_forget(facts, 0.1, seed)
    tokenizer = train_tokenizer([p + c for p, c in facts])  # one tokenizer for both, as build_demo's
    costs: dict[str, Cost] = {}
    models: dict[str, PreTrainedModel] = {}
    for name, train_facts in (("base", facts), ("retain", retain)):
        start = time.perf_counter()
        models[name] = train_model(tokenizer, train_facts, seed, steps, small)
        sequences = steps * min(DEFAULT_BATCH_SIZE, len(train_facts))
        costs[name] = Cost(time.perf_counter() - start, sequences, sequences, "training from scratch")
    sets = mini_tofu(facts, forget, seed, n_holdout=len(forget), pooled=pool is not None)
    engram, engram_costs, calibration = engram_rows(models, tokenizer, sets, work, budget, search)
    models.update(engram)
    costs.update(engram_costs)
    plain = {name: [p.probe for p in getattr(sets, name)] for name in ("forget", "retain")}
    for row, method in (("GradDiff", "graddiff"), ("NPO", "npo")):
        model, spent = unlearn(models["base"], tokenizer, plain["forget"], plain["retain"], method)  # type: ignore[arg-type]
        models[row] = model
        costs[row] = Cost(spent.seconds, spent.forward, spent.backward, f"{spent.steps} steps")
    raw = {name: model_report(model, tokenizer, sets) for name, model in models.items()}
    rows = {name: tm.tofu_scores(report, retain=raw["retain"], base=raw["base"]) for name, report in raw.items()}
    return rows, costs, calibration


def print_table(rows: dict[str, tm.ModelReport], costs: dict[str, Cost]) -> None:
    header = f"{'method':<12}" + "".join(f"{name:>10}" for name, _ in COLUMNS) + f"{'wall s':>9}{'fwd':>8}{'bwd':>8}"
    print(header)
    for method, report in rows.items():
        cells = "".join(f"{_cell(report.values.get(key)):>10}" for _, key in COLUMNS)
        cost = costs[method]
        print(f"{method:<12}{cells}{cost.seconds:>9.1f}{cost.forward:>8}{cost.backward:>8}")
    for method, cost in costs.items():
        print(f"{method}: {cost.note}")
    for method, report in rows.items():
        if report.left_out:
            print(f"{method}: left out: " + "; ".join(f"{k} ({v})" for k, v in sorted(report.left_out.items())))


def _calibration_line(result: dict[str, Any]) -> str:
    recommended = result.get("recommended")
    if recommended is None:
        return f"calibration: nothing recommended ({result.get('note')})"
    options = recommended["options"]
    bound = result["constraints"][0]
    return (
        f"calibration: {result['evaluations']} candidates; recommended α={options['alpha']:.3g} "
        f"{options['module_set']}/{options['scaling']}: overall {recommended['metrics']['overall']:.4f}, "
        f"model_utility {recommended['metrics']['model_utility']:.4f} (floor {bound['min']:.4f} = 0.9 × base's)"
    )


def _search_options(args: argparse.Namespace) -> dict[str, Any]:
    search: dict[str, Any] = {"module_sets": args.module_sets.split(",")}
    if args.layer_sets is not None:
        search["layer_sets"] = [[int(b) for b in blocks.split(",")] for blocks in args.layer_sets.split(";")]
    if args.alpha_max is not None:
        search["alpha_max"] = args.alpha_max
    return search


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tofu", description=__doc__.splitlines()[0])
    parser.add_argument("--n-facts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--quick", action="store_true", help="40 facts, the tests' tiny model, 150 steps: a smoke run")
    parser.add_argument("--small", action="store_true", help="the tests' tiny model shape (hidden 64, 2 layers)")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS})")
    parser.add_argument("--budget", type=int, default=40, help="the calibration's candidates (default 40)")
    parser.add_argument(
        "--answer-pool",
        type=int,
        default=None,
        help="answers per attribute shared by every person (default: the demo's, each answer distinct); see pooled_facts",
    )
    parser.add_argument("--module-sets", default="all,qk_gate", help="the calibration's module sets (presets)")
    parser.add_argument("--layer-sets", default=None, help="the calibration's block lists, e.g. 0;1;0,1 (default: all)")
    parser.add_argument("--alpha-max", type=float, default=None, help="the calibration's strongest α (default 4)")
    parser.add_argument("--json", type=Path, default=None, help="write every row's values and left-out names here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n_facts, steps = (40, 150) if args.quick else (args.n_facts, args.steps)
    with tempfile.TemporaryDirectory(prefix="bench-tofu-") as work:
        small = args.quick or args.small
        search = _search_options(args)
        rows, costs, calibration = run(n_facts, args.seed, steps, small, args.budget, Path(work), args.answer_pool, search)
    shape = "tiny shape (hidden 64, 2 layers)" if args.quick or args.small else "the demo's shape"
    answers = "distinct answers" if args.answer_pool is None else f"answers pooled by {args.answer_pool} per attribute"
    print(f"mini-TOFU: {n_facts} facts ({answers}), forget 10 %, seed {args.seed}, {steps} steps, {shape}", end="")
    print(f", {args.threads} threads")
    print_table(rows, costs)
    print(_calibration_line(calibration))
    if args.json is not None:
        payload = {m: {"values": r.values, "left_out": r.left_out, "seconds": costs[m].seconds} for m, r in rows.items()}
        args.json.write_text(json.dumps({"rows": payload, "calibration": calibration}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
