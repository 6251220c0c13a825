"""Does the forgetting hold? Each row of the real-model bench under the attacks of issue 37.

    python -m bench.robustness          # = python -m bench.real --robustness (both tables)
    python -m bench.robustness --quick  # the smoke run

For base, an Engram α of the grid, the calibrated variant, GradDiff and NPO (:mod:`bench.real`), with
the service's own attack code (:mod:`service.engine.attacks`, what an evaluation job's ``attacks``
run):

* **quantize Q4_1**: ``quantize_plan`` + ``quantize_in_place`` on a ``standalone_copy``: the ``gguf``
  package's Q4_1 round trip on the tensors llama.cpp quantizes (every 2-D decoder weight; the tied
  embedding/head, Q6_K in llama.cpp, kept), the type the model itself was published in; then every
  set scored again.
* **relearn**: ``relearned`` (k AdamW steps, lr and seed fixed, one batch of every training row, the
  answer tokens learned) on the first half of the forget facts in the concept; scored on the other
  half and on the held-out forget facts, which relearning never saw. ``recovered`` is the share of
  what was forgotten on those facts that came back: ``(after − before) / (base − before)``.
* **rephrase** (chat template): the service's ``as_chat`` (:mod:`service.engine.attacks.rephrase`, what
  ``{"kind": "rephrase", "form": "chat_template"}`` scores): every fact asked as a user turn and
  answered as the assistant's, through the model's chat template, on the unchanged model. A tokenizer
  without a chat template (the tests' tiny model) leaves the column out ("-").

The rows: base, every Engram α of the plan's grid, the calibrated variant, the calibrated variant
under the attack gate (``attack_constraints``: the plan's ``gate``) and GradDiff and NPO.

Scoring is :mod:`bench.real`'s (the evaluation job's functions); perplexity ratios are to the
unattacked base on the held-out paragraphs. The evaluation job runs the same attacks on base and
variant; here GradDiff and NPO, which are not service variants, go through the same functions.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.engine.attacks.quantize import quantize_in_place, quantize_plan
from service.engine.attacks.relearn import probe_row, relearned, standalone_copy
from service.engine.attacks.rephrase import as_chat
from service.engine.chat import has_chat_template
from service.engine.evaluate import TextProbe as Probe
from service.engine.evaluate import encode_probe, greedy_exact_match

if TYPE_CHECKING:
    from bench.real import Plan
    from bench.real_data import BenchData, Record


def quantized(model: Any, qtype: str) -> Any:
    """A copy of ``model`` after the service's ``qtype`` round trip (the model is left unchanged)."""
    plan = quantize_plan(model, qtype)
    attacked = standalone_copy(model)
    quantize_in_place(attacked, plan)
    return attacked


def relearned_on(model: Any, tokenizer: Any, records: Sequence[Record], steps: int, lr: float, seed: int = 0) -> Any:
    """A copy of ``model`` fine-tuned by the service's relearn loop on ``records``' answers."""
    rows = [probe_row(*encode_probe(tokenizer, Probe(r["prompt"], r["completion"]))) for r in records]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return relearned(model, rows, steps, lr, seed, int(pad or 0))


def _forget_and_kept(model: Any, tokenizer: Any, data: BenchData, base_text_nll: float, prefix: str) -> dict[str, float]:
    from bench.real import summaries, text_nll

    kept = [*data.kept, *data.held_kept, *data.unseen]
    row = {
        f"{prefix}forget data": summaries(model, tokenizer, data.forget)["exact_match"],
        f"{prefix}forget held": summaries(model, tokenizer, data.held_forget)["exact_match"],
        f"{prefix}kept": summaries(model, tokenizer, kept)["exact_match"],
    }
    row[f"{prefix}perplexity"] = math.exp(text_nll(model, tokenizer, data.held_general) - base_text_nll)
    return row


def rephrased(model: Any, tokenizer: Any, data: BenchData) -> dict[str, float]:
    """Exact match with every fact asked through the chat template (``as_chat``); NaN without one."""
    sets = {"chat:forget data": data.forget, "chat:forget held": data.held_forget}
    sets["chat:kept"] = [*data.kept, *data.held_kept, *data.unseen]
    if not has_chat_template(tokenizer):
        return dict.fromkeys(sets, math.nan)
    row = {}
    for column, records in sets.items():
        probes = [as_chat(Probe(r["prompt"], r["completion"])) for r in records]
        hits = greedy_exact_match(model, tokenizer, probes, batch_size=16)
        row[column] = sum(hits) / len(hits)
    return row


def attacked_row(model: Any, tokenizer: Any, data: BenchData, plan: Plan, base_text_nll: float) -> dict[str, float]:
    """One model before and after each attack (``relearn:`` figures on the facts relearning never saw)."""
    from bench.real import say, summaries, text_nll

    row = _forget_and_kept(model, tokenizer, data, base_text_nll, "")
    started = time.perf_counter()
    attacked = quantized(model, plan.quantization)
    row.update(_forget_and_kept(attacked, tokenizer, data, base_text_nll, f"{plan.quantization}:"))
    row[f"{plan.quantization}:seconds"] = time.perf_counter() - started
    say(f"{plan.quantization}: {row}")
    del attacked
    half = len(data.forget) // 2
    trained, untrained = data.forget[:half], [*data.forget[half:], *data.held_forget]
    row["relearn:before"] = summaries(model, tokenizer, untrained)["exact_match"]
    started = time.perf_counter()
    attacked = relearned_on(model, tokenizer, trained, plan.relearn_steps, plan.relearn_lr)
    row["relearn:after"] = summaries(attacked, tokenizer, untrained)["exact_match"]
    row["relearn:trained"] = summaries(attacked, tokenizer, trained)["exact_match"]
    kept = [*data.kept, *data.held_kept, *data.unseen]
    row["relearn:kept"] = summaries(attacked, tokenizer, kept)["exact_match"]
    row["relearn:perplexity"] = math.exp(text_nll(attacked, tokenizer, data.held_general) - base_text_nll)
    row["relearn:seconds"] = time.perf_counter() - started
    del attacked
    row.update(rephrased(model, tokenizer, data))
    return row


def attacked_rows(
    folders: dict[str, Path], tokenizer: Any, data: BenchData, plan: Plan, base_text_nll: float
) -> dict[str, dict[str, float]]:
    """Every chosen row under both attacks, one model in memory at a time; ``relearn:recovered`` per row."""
    from bench.real import load, say

    rows = {}
    for name, folder in folders.items():
        rows[name] = attacked_row(load(folder), tokenizer, data, plan, base_text_nll)
        say(f"attacked {name}: {rows[name]}")
    base_before = rows["base"]["relearn:before"] if "base" in rows else math.nan
    for row in rows.values():
        forgotten = base_before - row["relearn:before"]
        row["relearn:recovered"] = (row["relearn:after"] - row["relearn:before"]) / forgotten if forgotten > 0 else math.nan
    return rows


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def _table(head: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*out, *("| " + " | ".join(cells) + " |" for cells in lines)])


def robustness_table(rows: dict[str, dict[str, float]], plan: Plan) -> str:
    """The robustness tables as Markdown, one per attack: forget exact match (in data / held out), kept
    and perplexity, before and after it."""
    q = plan.quantization
    quantized = [
        [
            name,
            f"{_pct(r['forget data'])} / {_pct(r['forget held'])}",
            _pct(r["kept"]),
            f"×{r['perplexity']:.3f}",
            f"{_pct(r[f'{q}:forget data'])} / {_pct(r[f'{q}:forget held'])}",
            _pct(r[f"{q}:kept"]),
            f"×{r[f'{q}:perplexity']:.3f}",
        ]
        for name, r in rows.items()
    ]
    relearn = [
        [
            name,
            f"{_pct(r['relearn:before'])} → {_pct(r['relearn:after'])}",
            _pct(r.get("relearn:recovered", math.nan)),
            _pct(r["relearn:trained"]),
            _pct(r["relearn:kept"]),
            f"×{r['relearn:perplexity']:.3f}",
        ]
        for name, r in rows.items()
    ]
    chat = [
        [
            name,
            f"{_pct(r['forget data'])} / {_pct(r['forget held'])}",
            f"{_pct(r.get('chat:forget data', math.nan))} / {_pct(r.get('chat:forget held', math.nan))}",
            _pct(r["kept"]),
            _pct(r.get("chat:kept", math.nan)),
        ]
        for name, r in rows.items()
    ]
    return "\n\n".join(
        [
            _table(
                [
                    "model",
                    "forget data / held",
                    "kept",
                    "perplexity",
                    f"{q}: forget data / held",
                    f"{q}: kept",
                    f"{q}: perplexity",
                ],
                quantized,
            ),
            _table(
                [
                    "model",
                    f"relearn {plan.relearn_steps} steps: forget unseen by it, before → after",
                    "recovered",
                    "relearn: the facts trained on",
                    "relearn: kept",
                    "relearn: perplexity",
                ],
                relearn,
            ),
            _table(
                ["model", "forget data / held", "chat template: forget data / held", "kept", "chat template: kept"], chat
            ),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Without ``--folder``: ``python -m bench.real --robustness``. With ``--folder NAME=PATH`` (and
    ``--data``, ``--base``): attack checkpoints already built (a run's rows, in another process)."""
    import argparse
    import json
    import sys

    import torch
    from transformers import AutoTokenizer

    from bench.real import Plan, bench_data, load, text_nll
    from bench.real import main as real_main

    args = list(argv if argv is not None else sys.argv[1:])
    if "--folder" not in args:
        return real_main([*args, "--robustness"])
    parser = argparse.ArgumentParser(prog="python -m bench.robustness")
    parser.add_argument("--folder", action="append", required=True, help="NAME=PATH of a row's checkpoint")
    parser.add_argument("--base", type=Path, required=True, help="the base model's folder (perplexity ratios)")
    parser.add_argument("--data", type=Path, required=True, help="bench.real's --data file (drawn when missing)")
    parser.add_argument("--threads", type=int, default=1)
    parsed = parser.parse_args(args)
    torch.set_num_threads(parsed.threads)
    data = bench_data(parsed.base, parsed.data)
    tokenizer = AutoTokenizer.from_pretrained(parsed.base)
    base_nll = text_nll(load(parsed.base), tokenizer, data.held_general)
    folders = {name: Path(path) for name, path in (item.rsplit("=", 1) for item in parsed.folder)}
    rows = {}
    for name, folder in folders.items():
        rows[name] = attacked_row(load(folder), tokenizer, data, Plan(), base_nll)
        print(json.dumps({name: rows[name]}), flush=True)
    print(robustness_table(rows, Plan()))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
