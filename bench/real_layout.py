"""How the data's layout changes what an edit of the real LLM forgets and keeps (issue 36).

    python -m bench.real_layout [--threads 2] [--facts confident|known]   # 16 variants, ~6 min on 2 cores

On SmolLM2-135M-Instruct, through a live server (embedded mode, scratch store): the capitals and
chemical symbols the model knows with confidence (:func:`bench.real_data.confidently_known`, the
extended lists), split into the target concept's capitals (70%) and held-out capitals, the
symbols of the kept reference (45%), symbols no concept holds (25%: a calibration's retain probes
in the acceptance test) and held-out symbols (30%), and 180 paragraphs the model wrote (150 a
reference, 20 held out). Each layout is a universe:

* ``pairs``: the concepts' records as prompt/completion pairs (only the answer's tokens enter the
  statistics, as ai-engram's ``edit_llm`` counts them);
* ``sentences``: the same facts as sentences (text records: every token enters the statistics,
  the positions that predict the answer included).

For each layout, module set (every layer; MLP only) and α of :data:`ALPHAS`, the service builds the
variant (``POST /models/{id}/unlearn``, uniform scaling) and ``evaluate`` scores it on the held-out
sets. Cells: held-out capitals answered / held-out symbols kept / perplexity on the held-out
paragraphs (×, the base's = 1).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import real_data
from bench.real_data import Record
from engram_fixtures.live import LiveServer, start_server, stop_server, wait_for_job

MODEL_ID = "bench/real-layout"
LAYOUTS = ("pairs", "sentences")
MODULE_SETS = ("all", "mlp")
ALPHAS = (0.1, 0.15, 0.2, 0.3)


def layout_data(model_dir: Path, facts: str = "confident") -> dict[str, list[Record]]:
    """The splits (fixed seeds) of the facts the model knows (``facts``: "confident", with confidence;
    "known", every fact its argmax answers), and its paragraphs."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kept_of = real_data.confidently_known if facts == "confident" else real_data.known
    capitals = kept_of(
        model, tokenizer, real_data.fact_records({**real_data.CAPITALS, **real_data.MORE_CAPITALS}, "The capital of {} is")
    )
    symbols = kept_of(
        model,
        tokenizer,
        real_data.fact_records({**real_data.SYMBOLS, **real_data.MORE_SYMBOLS}, "The chemical symbol of {} is"),
    )
    capitals, symbols = random.Random(2).sample(capitals, len(capitals)), random.Random(3).sample(symbols, len(symbols))
    paragraphs = real_data.model_paragraphs(model, tokenizer, real_data.Sizes(per_opener=9))
    n_forget, n_ref, n_retain = round(0.7 * len(capitals)), round(0.45 * len(symbols)), round(0.25 * len(symbols))
    return {
        "forget": capitals[:n_forget],
        "held_forget": capitals[n_forget:],
        "kept": symbols[:n_ref],
        "retain": symbols[n_ref : n_ref + n_retain],  # in no concept: a calibration's retain probes
        "held_kept": symbols[n_ref + n_retain :],
        "reference_text": paragraphs[:150],
        "general": paragraphs[150:160],  # a calibration's utility.general
        "held_general": paragraphs[160:],
    }


def sentences(records: Sequence[Record]) -> list[Record]:
    return [{"text": f"{r['prompt']}{r['completion']}."} for r in records]


def register(server: LiveServer, model_dir: Path) -> None:
    """``POST /models`` of the scratch copy, waited for."""
    response = server.client.post("/models", json={"model_id": MODEL_ID, "source": f"file://{model_dir}"})
    assert response.status_code in (201, 202), response.text
    if response.status_code == 202:
        assert wait_for_job(server.client, response.json()["job_id"], timeout=3600)["status"] == "succeeded"


@contextmanager
def scratch_service(facts: str, prefix: str) -> Iterator[tuple[LiveServer, dict[str, list[Record]]]]:
    """A scratch copy of the real model, :func:`layout_data` of it (printed as counts) and a live
    server with the model registered; everything under a temporary folder, removed after."""
    from engram_fixtures.cache import copy_entry
    from engram_fixtures.real_llm import real_llm

    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        work = Path(scratch)
        model_dir = copy_entry(real_llm(), work / "models" / "smollm2-135m")
        data = layout_data(model_dir, facts)
        print(f"data: { {name: len(items) for name, items in data.items()} }", flush=True)
        server = start_server(work / "store", model_dir.parent, work / "server.log")
        try:
            register(server, model_dir)
            yield server, data
        finally:
            stop_server(server)


def post_concept(server: LiveServer, name: str, role: str, records: list[Record]) -> None:
    client = server.client
    response = client.post("/concepts", json={"name": name, "role": role, "models": [MODEL_ID], "records": records})
    assert response.status_code == 202, response.text
    job = wait_for_job(client, response.json()["jobs"][0]["job_id"], timeout=3600)
    assert job["status"] == "succeeded", job


MLP = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # the calibration's "mlp" module set on a Llama


def evaluated(server: LiveServer, variant_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = server.client.post(f"/variants/{variant_id}/evaluate", json=body)
    assert response.status_code in (200, 202), response.text
    job = response.json()
    if job["status"] not in ("succeeded", "failed", "cancelled"):
        job = wait_for_job(server.client, job["job_id"], timeout=3600)
    assert job["status"] == "succeeded", job
    return dict(job["result"]["summary"])


def measured(
    server: LiveServer, layout: str, modules: str, alpha: float, data: dict[str, list[Record]]
) -> tuple[float, ...]:
    """One variant (``POST /models/{id}/unlearn``) scored by ``evaluate`` on the held-out sets, then
    deleted: (capitals answered, symbols kept, perplexity ratio, the variant job's seconds)."""
    body: dict[str, Any] = {
        "concepts": [f"{layout}-capitals"],
        "reference": [f"{layout}-symbols", "paragraphs"],
        "alpha": alpha,
        **({"modules": MLP} if modules == "mlp" else {}),
    }
    started = time.monotonic()
    response = server.client.post(f"/models/{MODEL_ID}/unlearn", json=body)
    assert response.status_code in (200, 201, 202), response.text
    variant_id = response.json()["variant"]["variant_id"]
    if response.json().get("job"):
        assert wait_for_job(server.client, response.json()["job"]["job_id"], timeout=3600)["status"] == "succeeded"
    seconds = time.monotonic() - started
    facts = evaluated(server, variant_id, {"forget": data["held_forget"], "retain": data["held_kept"]})
    prose = evaluated(server, variant_id, {"retain": data["held_general"]})
    server.client.delete(f"/variants/{variant_id}")  # a checkpoint each: the scratch disk holds one at a time
    perplexity = math.exp(prose["variant"]["retain"]["mean_nll"] - prose["base"]["retain"]["mean_nll"])
    return facts["variant"]["forget"]["exact_match"], facts["variant"]["retain"]["exact_match"], perplexity, seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_layout", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--facts",
        choices=("confident", "known"),
        default="confident",
        help="the facts used: known with confidence (the default), or every fact the argmax answers",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    with scratch_service(args.facts, "bench-real-layout-") as (server, data):
        post_concept(server, "paragraphs", "reference", data["reference_text"])
        post_concept(server, "pairs-capitals", "target", data["forget"])
        post_concept(server, "pairs-symbols", "reference", data["kept"])
        post_concept(server, "sentences-capitals", "target", sentences(data["forget"]))
        post_concept(server, "sentences-symbols", "reference", sentences(data["kept"]))
        tables: dict[tuple[str, str, float], tuple[float, ...]] = {}
        for layout in LAYOUTS:
            for modules in MODULE_SETS:
                for alpha in ALPHAS:
                    tables[layout, modules, alpha] = measured(server, layout, modules, alpha, data)
                    print(f"{layout} {modules} α {alpha:g}: {tables[layout, modules, alpha]}", flush=True)
    print(f"\n{time.monotonic() - started:.0f} s. Held out: capitals answered / symbols kept / perplexity ×")
    print("| α | " + " | ".join(f"{layout}, {modules}" for layout in LAYOUTS for modules in MODULE_SETS) + " |")
    print("|---" * (1 + len(LAYOUTS) * len(MODULE_SETS)) + "|")
    for alpha in ALPHAS:
        cells = []
        for layout in LAYOUTS:
            for modules in MODULE_SETS:
                forget, kept, perplexity, _ = tables[layout, modules, alpha]
                cells.append(f"{forget:.0%} / {kept:.0%} / ×{perplexity:.3f}")
        print(f"| {alpha:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
