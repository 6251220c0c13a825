"""What a large multipart concept upload costs the API process: event-loop stall and peak RSS.

Starts the real server (``python -m service.cli serve``, embedded, file storage), posts a JSONL
dataset of about ``--mb`` MB as ``POST /concepts`` multipart, and meanwhile

- polls ``GET /healthz`` (answered on the event loop, touching nothing) every 10 ms: the longest
  answer while the upload is handled is the event-loop stall;
- samples the server's resident memory (``/proc/<pid>/status``: ``VmRSS`` every 10 ms, ``VmHWM``).

The concept names a model that is not registered, so the request parses, checks and spools the
whole dataset and then answers 404: only the upload's own cost is measured, no collection job runs.

    .venv/bin/python -m bench.upload_stall --mb 100
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx

from engram_fixtures.live import start_server, stop_server


def write_dataset(path: Path, megabytes: float) -> int:
    """Prompt/completion records of ~200 bytes until the file holds ``megabytes`` MB; returns the count."""
    rng = random.Random(0)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    target, count = int(megabytes * 1_000_000), 0
    with path.open("w") as out:
        while out.tell() < target:
            name = " ".join(rng.choice(words).title() for _ in range(3))
            prompt = f"Q: What is the favourite colour of {name} in the year {rng.randrange(1000, 3000)}? A:"
            completion = " " + " ".join(rng.choice(words) for _ in range(12))
            out.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            count += 1
    return count


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="dataset size in MB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="upload-stall-") as tmp:
        root = Path(tmp)
        (root / "models").mkdir()
        dataset = root / "dataset.jsonl"
        records = write_dataset(dataset, args.mb)
        size = dataset.stat().st_size
        server = start_server(root / "store", root / "models", root / "server.log", ENGRAM_CACHE_DIR=str(root / "cache"))
        pid = server.process.pid
        try:
            for _ in range(20):  # warm the route and the poller's connection
                server.client.get("/healthz")
            rss_before = proc_kib(pid, "VmRSS")
            stop = threading.Event()
            latencies: list[float] = []
            rss: list[int] = []

            def poll() -> None:
                with httpx.Client(base_url=server.base_url, timeout=60) as client:
                    while not stop.is_set():
                        started = time.perf_counter()
                        client.get("/healthz")
                        latencies.append(time.perf_counter() - started)
                        rss.append(proc_kib(pid, "VmRSS"))
                        time.sleep(0.01)

            poller = threading.Thread(target=poll)
            poller.start()
            time.sleep(0.2)
            started = time.perf_counter()
            with dataset.open("rb") as handle:
                response = server.client.post(
                    "/concepts",
                    data={"name": "big", "models": "org/not-registered"},
                    files={"dataset": ("big.jsonl", handle, "application/x-ndjson")},
                    timeout=600,
                )
            seconds = time.perf_counter() - started
            time.sleep(0.2)
            stop.set()
            poller.join()
            hwm = proc_kib(pid, "VmHWM")
        finally:
            stop_server(server)
    latencies.sort()
    result = {
        "dataset_mb": round(size / 1e6, 1),
        "records": records,
        "status": response.status_code,
        "detail": response.json().get("detail"),
        "request_s": round(seconds, 2),
        "healthz_polls": len(latencies),
        "healthz_max_ms": round(latencies[-1] * 1000, 1),
        "healthz_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 1),
        "healthz_median_ms": round(latencies[len(latencies) // 2] * 1000, 1),
        "rss_before_mb": round(rss_before / 1024),
        "rss_peak_sampled_mb": round(max(rss) / 1024),
        "vm_hwm_mb": round(hwm / 1024),
        "peak_over_idle_mb": round((hwm - rss_before) / 1024),
    }
    print(json.dumps(result, indent=1))  # noqa: T201


if __name__ == "__main__":
    main()
