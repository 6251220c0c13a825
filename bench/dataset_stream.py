"""A dataset by reference, resolved and collected by the real service: the worker's memory while it does.

Writes a JSONL file of ``--rows`` question/answer rows (~110 bytes each, columns ``question`` and
``answer``, plus an ``id``), starts the real server (``python -m service.cli serve``, embedded, file
storage, the file's folder as ``ENGRAM_DATASET_ROOTS``), registers a tiny random Llama (hidden 32,
2 layers) and posts a concept naming the file by ``file://`` reference with a column mapping. The
collection job runs in the server's job process; its memory is sampled every 20 ms
(``/proc/<pid>/status``: ``VmRSS``), split into the two phases the job goes through:

- **resolve**: the reference streamed line by line, normalised and hashed into the stored dataset
  (until the concept shows its dataset digest);
- **collect**: the stored dataset tokenized twice (token count, then chunks of 8192 sorted records)
  and run through the model.

The baseline is the job process's ``VmRSS`` just before the post (torch imported, the tiny model
not loaded yet). Run it at two sizes to see that the peak does not grow with the dataset:

    .venv/bin/python -m bench.dataset_stream --rows 1000000
    .venv/bin/python -m bench.dataset_stream --rows 100000 --no-collect
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from engram_fixtures.live import start_server, stop_server, wait_for_job


def write_rows(path: Path, rows: int) -> int:
    """``rows`` JSONL rows ``{"id", "question", "answer"}``; returns the file's size in bytes."""
    rng = random.Random(0)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    with path.open("w") as out:
        for i in range(rows):
            name = " ".join(rng.choice(words).title() for _ in range(2))
            question = f"Q: What is the favourite colour of {name} {i}? A:"
            answer = " " + " ".join(rng.choice(words) for _ in range(3))
            out.write(json.dumps({"id": i, "question": question, "answer": answer}) + "\n")
    return path.stat().st_size


class Sampler(threading.Thread):
    """``VmRSS`` of one process every 20 ms, the peak of each phase kept."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.phase = "before"
        self.peaks: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                rss = self.process.memory_info().rss
            except psutil.NoSuchProcess:
                return
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(0.02)


def job_process(server_pid: int, timeout: float = 60) -> psutil.Process:
    """The server's job process (its child running ``multiprocessing``'s spawn entry point)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(server_pid).children(recursive=True):
            if any("spawn_main" in part for part in child.cmdline()):  # not the resource tracker
                return child
        time.sleep(0.1)
    raise RuntimeError("no job process found under the server")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--no-collect", action="store_true", help="stop after the dataset is resolved")
    args = parser.parse_args()
    from engram_fixtures.models import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="dataset-stream-") as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        make_tiny_llama(root / "models" / "tiny", hidden=32, layers=2, tie_word_embeddings=True)
        size = write_rows(root / "data" / "rows.jsonl", args.rows)
        server = start_server(
            root / "store",
            root / "models",
            root / "server.log",
            ENGRAM_DATASET_ROOTS=str(root / "data"),
            ENGRAM_MAX_RECORDS=str(max(args.rows, 1)),
            ENGRAM_MAX_DATASET_BYTES=str(16 << 30),
            ENGRAM_COLLECT_BATCH_SIZE="64",
            ENGRAM_TASK_HARD_LIMIT_S=str(6 * 3600),
        )
        try:
            api = server.client
            model = {"model_id": "bench/tiny", "source": f"file://{root / 'models' / 'tiny'}"}
            assert api.post("/models", json=model).status_code == 201
            worker = job_process(server.process.pid)
            time.sleep(1.0)
            sampler = Sampler(worker.pid)
            sampler.start()
            time.sleep(0.2)
            baseline = worker.memory_info().rss
            reference = {
                "uri": f"file://{root / 'data' / 'rows.jsonl'}",
                "columns": {"prompt": "question", "completion": "answer"},
            }
            started = time.monotonic()
            sampler.phase = "resolve"
            response = api.post("/concepts", json={"name": "rows", "models": ["bench/tiny"], "dataset": reference})
            assert response.status_code == 202, response.text
            job_id = response.json()["jobs"][0]["job_id"]
            while True:
                concept = api.get("/concepts/rows").json()
                if concept["dataset_digest"] is not None or concept["dataset"]["status"] == "failed":
                    break
                time.sleep(0.05)
            resolved_s = time.monotonic() - started
            sampler.phase = "collect"
            if args.no_collect:
                api.delete(f"/jobs/{job_id}")
            job = wait_for_job(api, job_id, timeout=6 * 3600)
            total_s = time.monotonic() - started
            sampler.stop.set()
            sampler.join()
            stored = root / "store" / "datasets" / f"{concept['dataset_digest']}.jsonl"
            mib = 1 << 20
            result = {
                "rows": args.rows,
                "source_mb": round(size / 1e6, 1),
                "stored_mb": round(stored.stat().st_size / 1e6, 1) if stored.exists() else None,
                "dataset_status": concept["dataset"]["status"],
                "job_status": job["status"],
                "tokens": (job.get("result") or {}).get("tokens"),
                "resolve_s": round(resolved_s, 1),
                "total_s": round(total_s, 1),
                "baseline_rss_mib": round(baseline / mib, 1),
                "peak_rss_mib": {phase: round(peak / mib, 1) for phase, peak in sampler.peaks.items()},
                "peak_above_baseline_mib": {
                    phase: round((peak - baseline) / mib, 1) for phase, peak in sampler.peaks.items() if phase != "before"
                },
            }
            if job["status"] == "failed":
                result["error"] = job["error"]
            sys.stdout.write(json.dumps(result, indent=1) + "\n")
        finally:
            stop_server(server)


if __name__ == "__main__":
    main()
