"""The API process's memory, idle and after serving a memory-trace map (issue 13: the API runs no model).

Starts the real server (``python -m service.cli serve``, embedded mode, file storage), registers a
random Llama (hidden 512, 4 blocks, vocabulary 32k: 50M parameters), collects two small concepts
and asks for their map. It reads the API process's ``VmRSS`` (now) and ``VmHWM`` (its peak) from
``/proc`` when idle after startup, once the concepts are ready, and after the map was answered. The
job process (embedded mode's worker) is a separate process and is not counted: what a map costs
there is what a worker pays.

Before maps and registrations became jobs, the API process built the model on the meta device,
hashed the checkpoint, loaded the weights and decomposed ``Σ_U`` itself; the same script, run from
a checkout of that commit, measures the difference::

    .venv/bin/python -m bench.api_memory --out /tmp/api-memory.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import Profile, build_model
from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, start_server, stop_server, wait_concepts_ready

MODEL_ID = "bench/api-memory"
PROFILE = Profile(
    name="api-memory",
    hidden=512,
    layers=4,
    intermediate=2048,
    heads=8,
    vocab=32000,
    collect_records=16,
    facts_per_record=4,
    concept_records=16,
    compose_concepts=(1,),
    compose_reps=1,
    collect_reps=1,
    ai_collect_records=16,
    subsets=False,
)
MAP_TIMEOUT_S = 600.0


def memory_mb(pid: int) -> dict[str, float]:
    """``VmRSS`` (resident now) and ``VmHWM`` (the resident peak) of a process, in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mb": fields["VmRSS"], "peak_mb": fields["VmHWM"]}


def prepare(api: httpx.Client, model_dir: Path) -> None:
    """Register the model and collect two concepts on it (the job process does the collection)."""
    response = api.post("/models", json={"model_id": MODEL_ID, "source": f"file://{model_dir}"})
    response.raise_for_status()
    facts = make_facts(48, seed=11)
    for name, role, chosen in (("mem-a", "target", facts[:8]), ("mem-ref", "reference", facts[8:])):
        records = [{"prompt": p, "completion": c} for p, c in chosen]
        body = {"name": name, "role": role, "models": [MODEL_ID], "records": records}
        api.post("/concepts", json=body).raise_for_status()
    wait_concepts_ready(api, ["mem-a", "mem-ref"], MODEL_ID, timeout=600)


def fetch_map(api: httpx.Client) -> tuple[float, int]:
    """Ask for the map until it is answered (a 202 means its job still runs); seconds and answers."""
    started, answers = time.monotonic(), 0
    while time.monotonic() - started < MAP_TIMEOUT_S:
        response = api.get(f"/models/{MODEL_ID}/engram-map", params={"concepts": "mem-a,mem-ref"}, timeout=120)
        answers += 1
        if response.status_code == 200:
            return time.monotonic() - started, answers
        if response.status_code != 202:
            raise RuntimeError(f"the map was refused: {response.status_code} {response.text}")
        time.sleep(1.0)
    raise TimeoutError(f"no map within {MAP_TIMEOUT_S:.0f} s")


def measure(root: Path) -> dict[str, Any]:
    model_dir = build_model(PROFILE, root / "models" / "llama")
    server: LiveServer = start_server(root / "store", root / "models", root / "server.log")
    try:
        pid = server.process.pid
        time.sleep(2.0)
        idle = memory_mb(pid)
        prepare(server.client, model_dir)
        ready = memory_mb(pid)
        seconds, answers = fetch_map(server.client)
        after = memory_mb(pid)
    finally:
        stop_server(server)
    return {
        "model": {"hidden": PROFILE.hidden, "blocks": PROFILE.layers, "vocab": PROFILE.vocab},
        "api_idle": idle,
        "api_concepts_ready": ready,
        "api_after_map": after,
        "map_s": round(seconds, 2),
        "map_requests": answers,
        "api_peak_growth_for_the_map_mb": round(after["peak_mb"] - ready["peak_mb"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-api-memory-") as tmp:
        figures = measure(Path(tmp))
    text = json.dumps(figures, indent=1)
    print(text)  # noqa: T201 - the bench's report
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
