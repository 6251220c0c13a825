"""α=1 unlearning on the real LLM with and without a reference the model drew itself (issue 36).

    python -m bench.sampled_reference [--count 240] [--max-new-tokens 128] [--data data.json]

Through a live server (embedded mode, scratch store): SmolLM2-135M-Instruct registered, the
capitals (target) and chemical symbols (kept, a reference) of :mod:`bench.real_data` collected, and a
``samples`` concept (``POST /concepts`` with ``{"samples": {count, max_new_tokens, temperature 1,
seed 0}}``) drawn by the model; then ``unlearn`` at α=1 and α=0.5 with reference [target, kept]
(no general text) and [target, kept, samples]. Each variant scored as :mod:`bench.real` scores
(exact match on the forget facts in data / held out, kept facts in data / held out, perplexity ratio
on held-out general text).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.real import MODEL_ID, _job, _variant_folder, bench_data, load, say, score
from engram_fixtures.live import post_and_wait, start_server, stop_server, wait_for_job
from engram_fixtures.real_llm import real_llm

TARGET, KEPT, SELF = "sr-forget", "sr-kept", "sr-self"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=240)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--data", type=Path, default=None)
    args = parser.parse_args(argv)
    model_dir = real_llm()
    data = bench_data(model_dir, args.data)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = score(load(model_dir), tokenizer, data, None)
    rows = {"base": base}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = start_server(work / "store", model_dir.parent, work / "server.log")
        try:
            client = server.client
            post_and_wait(client, "/models", {"model_id": MODEL_ID, "source": f"file://{model_dir}"}, 1800)
            samples = {"count": args.count, "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "seed": 0}
            bodies: list[dict[str, Any]] = [
                {"name": TARGET, "role": "target", "records": data.forget},
                {"name": KEPT, "role": "reference", "records": data.kept},
                {"name": SELF, "samples": samples},
            ]
            started = time.perf_counter()
            for body in bodies:
                response = client.post("/concepts", json={**body, "models": [MODEL_ID]})
                assert response.status_code == 202, response.text
                for job in response.json()["jobs"]:
                    assert wait_for_job(client, job["job_id"], timeout=7200)["status"] == "succeeded", job
            say(f"collected (with {args.count} samples drawn) in {time.perf_counter() - started:.0f} s")
            for alpha in args.alphas:
                for label, reference in (("no general text", [TARGET, KEPT]), ("self-samples", [TARGET, KEPT, SELF])):
                    request = {"concepts": [TARGET], "reference": reference, "alpha": alpha}
                    response = client.post(f"/models/{MODEL_ID}/unlearn", json=request)
                    if response.json().get("job"):
                        _job(client, response)
                    folder = _variant_folder(server, response.json()["variant"]["variant_id"])
                    rows[f"α={alpha:g}, {label}"] = score(load(folder), tokenizer, data, base["text_nll"])
                    say(f"α={alpha:g}, {label}: {rows[f'α={alpha:g}, {label}']}")
        finally:
            stop_server(server)
    print("| unlearn | forget in data / held out | kept in data / held out | perplexity |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        forget = f"{row['forget data']:.0%} / {row['forget held']:.0%}"
        kept = f"{row['kept data']:.0%} / {row['kept held']:.0%}"
        print(f"| {name} | {forget} | {kept} | ×{row['perplexity']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
