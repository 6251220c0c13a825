"""Heavy polling against a real embedded server: status latency, and what it does to a collection.

    .venv/bin/python -m bench.polling                  # 200 pollers, 0.2 s think time (~1000 req/s offered)
    .venv/bin/python -m bench.polling --clients 200 --interval 0.1 --seconds 20

What runs: ``engram-service serve`` (embedded: the API plus its job process, file storage), a
random Llama (hidden 384, 4 layers) registered from a temporary model root, and
:mod:`bench.pollers` in a process of its own, whose clients poll ``GET /jobs/{id}`` and
``GET /concepts/{name}`` in turn. Figures:

- polling latency and throughput with the service idle, and while a collection runs;
- a collection's own duration (the job's ``started_at`` → ``finished_at``) idle and under polling,
  alternated (idle, polled, idle, polled) so that drift hits both alike; the ratio is the slowdown.

Writes ``bench/results/polling.json`` and prints a table. The exit status is 0 whatever the results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import LLAMA_TINY, build_model, median, text_records
from engram_fixtures.live import LiveServer, start_server, stop_server, wait_for_job

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_ID = "bench/polled"
PROFILE = LLAMA_TINY.__class__(
    **{
        **LLAMA_TINY.__dict__,
        "name": "llama-polling",
        "hidden": 384,
        "layers": 4,
        "intermediate": 1024,
        "heads": 6,
        "vocab": 2048,
    }
)


def _concept(server: LiveServer, name: str, records: int, seed: int) -> dict[str, Any]:
    body = {"name": name, "models": [MODEL_ID], "records": [r.to_json() for r in text_records(records, 8, seed)]}
    answer = server.client.post("/concepts", json=body)
    answer.raise_for_status()
    return answer.json()["jobs"][0]


def _duration_s(job: dict[str, Any]) -> float:
    started, finished = (datetime.fromisoformat(job[k]) for k in ("started_at", "finished_at"))
    return (finished - started).total_seconds()


def _pollers(server: LiveServer, paths: list[str], clients: int, interval: float, seconds: float) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "bench.pollers",
        "--url",
        server.base_url,
        "--clients",
        str(clients),
        "--interval",
        str(interval),
        "--seconds",
        str(seconds),
    ]
    for path in paths:
        command += ["--path", path]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _collect(server: LiveServer, name: str, records: int, seed: int) -> float:
    job = _concept(server, name, records, seed)
    finished = wait_for_job(server.client, job["job_id"], timeout=600)
    assert finished["status"] == "succeeded", finished
    return _duration_s(finished)


def run(clients: int, interval: float, seconds: float, records: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-polling-") as tmp:
        root = Path(tmp)
        build_model(PROFILE, root / "models" / "polled")
        server = start_server(root / "storage", root / "models", root / "server.log")
        try:
            answer = server.client.post("/models", json={"model_id": MODEL_ID, "source": f"file://{root}/models/polled"})
            answer.raise_for_status()
            warm = _concept(server, "warm-up", 4, seed=1)  # loads the model in the job process
            wait_for_job(server.client, warm["job_id"], timeout=600)
            paths = [f"/jobs/{warm['job_id']}", "/concepts/warm-up"]

            idle_poll = _pollers(server, paths, clients, interval, seconds)
            idle_latency = json.loads(idle_poll.communicate()[0])

            idle, polled, busy_latency = [], [], []
            for rep in range(2):
                idle.append(_collect(server, f"idle-{rep}", records, seed=10 + rep))
                poll = _pollers(server, paths, clients, interval, seconds=3600)
                time.sleep(2.0)  # every client connected and polling
                polled.append(_collect(server, f"polled-{rep}", records, seed=20 + rep))
                poll.terminate()
                poll.wait()
                # a bounded window while a collection runs, for the latency figures
                job = _concept(server, f"measured-{rep}", records, seed=30 + rep)
                during = _pollers(
                    server,
                    [f"/jobs/{job['job_id']}", f"/concepts/measured-{rep}"],
                    clients,
                    interval,
                    min(seconds, 0.8 * idle[-1]),
                )
                busy_latency.append(json.loads(during.communicate()[0]))
                wait_for_job(server.client, job["job_id"], timeout=600)
        finally:
            stop_server(server)
    return {
        "clients": clients,
        "interval_s": interval,
        "records": records,
        "polling_idle": idle_latency,
        "polling_during_collection": busy_latency,
        "collection_idle_s": idle,
        "collection_polled_s": polled,
        "collection_slowdown": median(polled) / median(idle),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.2, help="think time between a client's polls")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each latency window")
    parser.add_argument("--records", type=int, default=48, help="text records (8 facts each) per collection")
    args = parser.parse_args()
    result = run(args.clients, args.interval, args.seconds, args.records)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "polling.json").write_text(json.dumps(result, indent=2))
    rows = [("idle", result["polling_idle"])] + [
        (f"during collection {i}", r) for i, r in enumerate(result["polling_during_collection"])
    ]
    for label, r in rows:
        print(  # noqa: T201
            f"{label:>22}: {r['throughput_rps']:7.1f} req/s  p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms"
            f"  max {r['max_ms']:7.1f} ms  errors {r['errors'] or 0}"
        )
    idle, polled = result["collection_idle_s"], result["collection_polled_s"]
    print(f"collection idle {idle} s, polled {polled} s: slowdown {result['collection_slowdown']:.2f}x")  # noqa: T201


if __name__ == "__main__":
    main()
