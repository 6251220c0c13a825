"""Time to the first variant of a new universe for a request that edits some modules only (issue 27).

A Q/K+Gate request (``modules: q_proj, k_proj, gate_proj``) needs only the input groups of those
layers: the attention input and the MLP input, not ``down_proj``'s (8192 wide on Llama-3.2-1B). This
bench runs the real server (embedded, file storage) on a random Llama of a bench profile, collects
four concepts, and times, POST to ready:

- **whole universe first** (what every request waited for before): ``POST /models/{id}/universes`` of
  two concepts, then the Q/K+Gate variant on it;
- **only what it needs**: the Q/K+Gate variant on a new universe of the two other concepts (its job
  builds the groups it needs, defers the others: the job's ``progress.groups`` says which);
- **deferred later**: a ``down_proj`` variant on that universe, which builds the deferred groups.

    .venv/bin/python -m bench.first_variant --profile 1b-slice
    .venv/bin/python -m bench.first_variant --profile tiny      # a smoke run

Prints a table and writes ``bench/results/first-variant-<profile>.json`` (or ``--json``), with the
machine's load average at the start and the end (on a shared machine, figures are only as good as it
was quiet).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import build_model, environment, text_records
from bench.e2e import MODEL_ID, PROFILES, REPO, Embedded
from engram_fixtures.live import LiveServer, post_and_wait, wait_concepts_ready

QK_GATE = ["q_proj", "k_proj", "gate_proj"]
TIMEOUT_S = 7200


def _post_and_wait(server: LiveServer, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """POST ``body`` and wait for its job (if any); the seconds and the finished job."""
    started = time.perf_counter()
    _, finished = post_and_wait(server.client, path, body, timeout=TIMEOUT_S)
    return time.perf_counter() - started, finished


def _unlearn(server: LiveServer, concepts: list[str], modules: list[str], alpha: float) -> dict[str, Any]:
    body = {"concepts": concepts[:1], "alpha": alpha, "reference": concepts, "modules": modules}
    seconds, job = _post_and_wait(server, f"/models/{MODEL_ID}/unlearn", body)
    assert job is not None, "a new variant is built"
    result = job.get("result") or {}
    return {
        "wall_s": round(seconds, 3),
        "universe_s": (result.get("steps") or {}).get("universe"),
        "groups": job["progress"].get("groups"),
    }


def measure(profile_name: str, root: Path) -> dict[str, Any]:
    profile = PROFILES[profile_name]
    model_root = root / "models"
    model_dir = build_model(profile, model_root / "llama")
    # bench.e2e's embedded deployment: measured once its job process is ready, as bench.e2e measures
    deployment = Embedded(root, model_root)
    try:
        server = deployment.start("first-variant")
        api = server.client
        source = {"model_id": MODEL_ID, "source": f"file://{model_dir}"}
        post_and_wait(api, "/models", source, timeout=600, params={"wait": 60})  # a 202 is the register job
        names = []
        for k in range(4):
            records = [r.to_json() for r in text_records(profile.concept_records, profile.facts_per_record, seed=100 + k)]
            names.append(f"fv-concept{k}")
            post_and_wait(api, "/concepts", {"name": names[-1], "records": records, "models": [MODEL_ID]}, TIMEOUT_S)
        wait_concepts_ready(api, names, MODEL_ID, timeout=TIMEOUT_S)
        whole, needed = names[:2], names[2:]
        built_s, _ = _post_and_wait(server, f"/models/{MODEL_ID}/universes", {"concepts": whole})
        before = _unlearn(server, whole, QK_GATE, 1.0)
        after = _unlearn(server, needed, QK_GATE, 1.0)
        later = _unlearn(server, needed, ["down_proj"], 1.0)
    finally:
        deployment.close()
    return {
        "profile": profile.name,
        "whole_universe_first": {
            "universe_s": round(built_s, 3),
            "variant": before,
            "total_s": round(built_s + before["wall_s"], 3),
        },
        "only_what_it_needs": after,
        "deferred_down_proj_later": later,
    }


def table(result: dict[str, Any]) -> str:
    load = result.get("environment", {})
    whole, after, later = result["whole_universe_first"], result["only_what_it_needs"], result["deferred_down_proj_later"]
    deferred = (after["groups"] or {}).get("deferred", [])
    return "\n".join(
        [
            f"first Q/K+Gate variant of a new universe, {result['profile']} (POST to ready; load average "
            f"{load.get('loadavg_start', '?')} -> {load.get('loadavg_end', '?')})",
            f"  whole universe first: {whole['total_s']:.1f} s (universe {whole['universe_s']:.1f} s + variant "
            f"{whole['variant']['wall_s']:.1f} s)",
            f"  only what it needs:   {after['wall_s']:.1f} s (its universe step {after['universe_s']} s; "
            f"deferred {len(deferred)} groups: {', '.join(deferred)})",
            f"  down_proj later:      {later['wall_s']:.1f} s (built {', '.join((later['groups'] or {}).get('built', []))})",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="1b-slice")
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument(
        "--json", type=Path, default=None, help="result file (default bench/results/first-variant-PROFILE.json)"
    )
    args = parser.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-first-variant-"))
    root.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    try:
        result = measure(args.profile, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    result["environment"] = {
        **environment(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    out = args.json or REPO / "bench" / "results" / f"first-variant-{args.profile}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"(written to {out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
