"""A fine α grid of Engram on the real LLM, scored as :mod:`bench.real` scores (issue 36).

    python -m bench.real_grid [--alphas 0.1 0.15 0.2 0.25 0.3] [--data bench/results/real-data.json]

Through a live server (embedded mode, scratch store): :func:`bench.real.setup_service` (register,
collect the capitals, symbols and paragraphs, build their universe), then one ``unlearn`` per α
(uniform, every layer, reference the three concepts) and :func:`bench.real.score` on it: the table
says where the held-out kept facts start to go against the ones in the reference (what a
calibration's retain floor sees when its retain probes are the reference's records).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.real import bench_data, engram_variant, load, say, score, setup_service

COLUMNS = ("forget data", "forget held", "kept data", "kept held", "unseen kind")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_grid", description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.125, 0.15, 0.175, 0.2, 0.225, 0.25, 0.3])
    parser.add_argument("--data", type=Path, default=None, help="the data's JSON (bench.real --data)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engram_fixtures.cache import copy_entry
    from engram_fixtures.live import start_server, stop_server
    from engram_fixtures.real_llm import real_llm

    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-real-grid-") as scratch:
        work = Path(scratch)
        model_dir = copy_entry(real_llm(), work / "models" / "smollm2-135m")
        data = bench_data(model_dir, args.data)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        base = score(load(model_dir), tokenizer, data, None)
        server = start_server(work / "store", model_dir.parent, work / "server.log")
        try:
            say(f"setup: {setup_service(server, model_dir, data)}")
            for alpha in args.alphas:
                built = engram_variant(server, {"alpha": alpha})
                rows[f"{alpha:g}"] = score(load(built.folder), tokenizer, data, base["text_nll"])
                say(f"α={alpha:g}: {rows[f'{alpha:g}']}")
        finally:
            stop_server(server)
    print(f"data: {data.counts()}")
    print("| α | " + " | ".join(COLUMNS) + " | perplexity |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.0%}" for c in COLUMNS) + f" | ×{row['perplexity']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
