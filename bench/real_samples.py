"""How far a self-sampled general-text reference goes on the real LLM (issue 36), by size and temperature.

    python -m bench.real_samples [--threads 2] [--counts 240 480] [--cool 0.7] [--alphas 0.5 1]

Issue 36 measured 240 texts of 128 tokens the model drew itself (temperature 1), added to a universe
without general text: α = 1 went from perplexity ×5.6 to ×1.12 and kept facts from 0% to 36%
(α = 0.5: 86%, ×1.01), and asked how far a larger or better-drawn sample goes. Here, on
SmolLM2-135M-Instruct through a live server (embedded mode, scratch store), with
:func:`bench.real_layout.layout_data`'s facts (every fact the argmax answers: the kept facts a
platform has) as prompt/completion pairs: the capitals' target concept and the symbols' reference,
plus one general-text reference per row:

* ``none``: no general text (the universe is the two fact concepts);
* ``samples N @ T``: ``POST /concepts`` with ``"samples": {"count": N, "max_new_tokens": 128,
  "temperature": T}`` (drawn by the collection job from the model's BOS token);
* ``paragraphs``: the 150 paragraphs the model wrote from everyday openers (a real corpus's stand-in).

Each row is unlearned (``unlearn``, every layer, uniform) at each α and scored by ``evaluate`` on the
held-out sets: capitals answered / symbols kept / perplexity × on the 20 held-out paragraphs.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import torch

from bench.real_data import Record
from bench.real_layout import MODEL_ID, evaluated, post_concept, scratch_service
from engram_fixtures.live import LiveServer, wait_for_job

SAMPLE_TOKENS = 128


def sampled_concept(server: LiveServer, name: str, count: int, temperature: float) -> float:
    """A self-sampled reference concept, collected; the seconds its job took (drawing included)."""
    started = time.monotonic()
    body = {
        "name": name,
        "role": "reference",
        "models": [MODEL_ID],
        "samples": {"count": count, "max_new_tokens": SAMPLE_TOKENS, "temperature": temperature, "seed": 0},
    }
    response = server.client.post("/concepts", json=body)
    assert response.status_code == 202, response.text
    job = wait_for_job(server.client, response.json()["jobs"][0]["job_id"], timeout=7200)
    assert job["status"] == "succeeded", job
    return time.monotonic() - started


def scored(server: LiveServer, reference: list[str], alpha: float, data: dict[str, list[Record]]) -> tuple[float, ...]:
    """``unlearn`` of the capitals against ``reference`` at ``alpha``, scored on the held-out sets, deleted."""
    body = {"concepts": ["capitals"], "reference": ["symbols", *reference], "alpha": alpha}
    response = server.client.post(f"/models/{MODEL_ID}/unlearn", json=body)
    assert response.status_code in (200, 201, 202), response.text
    variant_id = response.json()["variant"]["variant_id"]
    if response.json().get("job"):
        assert wait_for_job(server.client, response.json()["job"]["job_id"], timeout=7200)["status"] == "succeeded"
    facts = evaluated(server, variant_id, {"forget": data["held_forget"], "retain": data["held_kept"]})
    prose = evaluated(server, variant_id, {"retain": data["held_general"]})
    server.client.delete(f"/variants/{variant_id}")
    perplexity = math.exp(prose["variant"]["retain"]["mean_nll"] - prose["base"]["retain"]["mean_nll"])
    return facts["variant"]["forget"]["exact_match"], facts["variant"]["retain"]["exact_match"], perplexity


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_samples", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--counts", type=int, nargs="+", default=[240, 480], help="sample sizes at temperature 1")
    parser.add_argument("--cool", type=float, default=0.7, help="a second temperature, for the smallest count")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.5, 1.0])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    rows: dict[str, list[str]] = {"none": []}
    table: dict[tuple[str, float], tuple[float, ...]] = {}
    with scratch_service("known", "bench-real-samples-") as (server, data):
        post_concept(server, "capitals", "target", data["forget"])
        post_concept(server, "symbols", "reference", data["kept"])
        post_concept(server, "paragraphs", "reference", data["reference_text"])
        # the cheap rows first, then each draw's row as soon as it is drawn: every line printed is a result
        rows["paragraphs"] = ["paragraphs"]
        counts = sorted(args.counts)  # the smallest at both temperatures first: the larger draws cost most
        draws = [(counts[0], 1.0), (counts[0], args.cool)] + [(count, 1.0) for count in counts[1:]]
        for count, temperature in [(0, 0.0), *draws]:
            row = "none" if count == 0 else f"samples {count} @ T {temperature:g}"
            if count:
                name = f"samples-{count}-t{temperature:g}".replace(".", "_")
                seconds = sampled_concept(server, name, count, temperature)
                rows[row] = [name]
                print(f"{row}: drawn and collected in {seconds:.0f} s", flush=True)
            for scored_row in [row, "paragraphs"] if count == 0 else [row]:
                for alpha in args.alphas:
                    table[scored_row, alpha] = scored(server, rows[scored_row], alpha, data)
                    print(f"{scored_row} α {alpha:g}: {table[scored_row, alpha]}", flush=True)
    print(f"\n{time.monotonic() - started:.0f} s. Held out: capitals answered / symbols kept / perplexity ×")
    print("| general-text reference | " + " | ".join(f"α {alpha:g}" for alpha in args.alphas) + " |")
    print("|---" * (1 + len(args.alphas)) + "|")
    for row in [r for r in rows if all((r, alpha) in table for alpha in args.alphas)]:
        cells = [f"{f:.0%} / {k:.0%} / ×{p:.3f}" for f, k, p in (table[row, alpha] for alpha in args.alphas)]
        print(f"| {row} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
