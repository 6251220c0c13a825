"""What a user waits for: a variant through the HTTP API, POST to ready, against the copy floor.

``bench.universe`` times the arithmetic as a function; a user POSTs ``/models/{id}/unlearn`` and
waits for the job. This bench runs the real service, in one of two deployments (``--mode``):

- **embedded**: ``engram-service serve`` with its embedded job process, on file storage;
- **distributed**: the API, one Celery worker (``engram-service worker``), a private Redis and an
  S3 store (SeaweedFS, signatures checked), as ``docker-compose.yml`` deploys them;

registers a random Llama of a bench profile, collects ``CONCEPTS``
concepts, builds their universe, then times variants of 1 and 3 concepts:

- **warm**: the server that built the universe, second and later variants;
- **after restart**: a fresh server (distributed: a fresh API and worker) on the same storage, its
  first variant (nothing cached in any process; the universe and engrams are read back from the
  store; a worker's download cache on disk stays, as it does when a pod restarts on its node).

Each variant asks for a new ``alpha`` so that no answer is a stored one. The client's wall time runs
from the POST to the moment ``GET /variants/{id}`` says ``ready`` (polled every
``POLL_S``: the figure is at most that much late); the job's own timestamps split it into the wait
in the queue and the job's run, and the job's ``result.steps`` (where the service reports them) into
its steps. Three floors are measured in the same run, after each variant:

- the **copy floor**: ``load_file`` + ``save_file`` of every shard of the model's checkpoint;
- the **variant floor**: the same for the variant's own files, plus their sha256 (a variant's
  manifest needs it): the fair floor where the variant is bigger than its model (an edited tied
  head is untied: the 1B slice's variant is 1.26 GB against a 0.73 GB checkpoint);
- distributed only, the **store floor**: the variant floor, then an upload of those files to the
  same bucket (``S3Storage.put_file``): what the variant must cost at least to reach S3.

The ratios are printed against the copy floor and against the deployment's own floor (the variant
floor embedded, the store floor distributed).

    .venv/bin/python -m bench.e2e --profile 100m                      # ~4 min on a quiet 2-core box
    .venv/bin/python -m bench.e2e --profile 100m --mode distributed   # Celery + S3
    .venv/bin/python -m bench.e2e --profile tiny --reps 2             # a smoke run (~40 s)

Prints a table and writes ``bench/results/e2e-<profile>[-distributed].json`` (or ``--json``); ``make bench`` runs it
(``bench.run``: the 100m profile, the tiny one with ``--quick``) and prints its ratios beside its own.
The machine's load average at the start and the end is part of the result: on a shared machine the
figures are only as good as it was quiet.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from bench.common import LLAMA_1B_SLICE, LLAMA_100M, LLAMA_TINY, Profile, build_model, environment, text_records
from bench.compose import copy_floor, variant_floor
from engram_fixtures.live import (
    LiveServer,
    RedisServer,
    kill_worker,
    post_and_wait,
    server_env,
    start_redis,
    start_server,
    start_worker,
    stop_redis,
    stop_server,
    wait_concepts_ready,
)
from engram_fixtures.seaweed import SeaweedServer, new_bucket, start_seaweed, stop_seaweed
from service.storage.s3 import S3Storage

REPO = Path(__file__).resolve().parent.parent
PROFILES = {"tiny": LLAMA_TINY, "100m": LLAMA_100M, "1b-slice": LLAMA_1B_SLICE}
MODEL_ID = "bench/e2e"
CONCEPTS = 4
VARIANT_SIZES = (1, 3)
POLL_S = 0.01
GOALS = {1: 1.5, 3: 2.5}  # issue 27: after a restart, ≤ 1.5× (1 concept) and ≤ 2.5× (3) the copy floor
READY_TIMEOUT_S = 300
Mode = Literal["embedded", "distributed"]


@dataclass
class VariantTiming:
    """One variant, POST to ready, as the client saw it and as the job recorded it."""

    concepts: int
    phase: str  # "warm" or "after restart"
    wall_s: float
    queued_s: float | None
    run_s: float | None
    steps: dict[str, float] = field(default_factory=dict)
    variant_id: str = ""
    copy_floor_s: float = 0.0  # the floors measured right after it (see the module's docstring)
    own_floor_s: float = 0.0


def _iso_seconds(stamp: str | None) -> float | None:
    return None if stamp is None else datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _job_split(job: dict[str, Any]) -> tuple[float | None, float | None]:
    """(seconds in the queue, seconds running) from the job's own timestamps."""
    created, started, finished = (_iso_seconds(job.get(k)) for k in ("created_at", "started_at", "finished_at"))
    queued = None if created is None or started is None else started - created
    run = None if started is None or finished is None else finished - started
    return queued, run


def _wait_ready(server: LiveServer, ready: Any) -> None:
    """Poll ``/readyz`` until ``ready(status code, body)`` says the service can run jobs."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        answer = server.client.get("/readyz")
        if ready(answer.status_code, answer.json()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready to run jobs within {READY_TIMEOUT_S} s: {answer.text}\n{server.log_tail()}")
        time.sleep(0.1)


class Embedded:
    """``engram-service serve`` with its embedded job process, on file storage under ``root``."""

    mode: Mode = "embedded"

    def __init__(self, root: Path, model_root: Path) -> None:
        self.root, self.model_root = root, model_root
        self.server: LiveServer | None = None

    def start(self, name: str) -> LiveServer:
        self.server = start_server(self.root / "store", self.model_root, self.root / f"{name}.log")
        # A restarted service is measured once it is ready to run jobs (its job process has imported the
        # job bodies), as a user's request meets it: a restart is rarely a second before the request.
        _wait_ready(self.server, lambda code, body: body.get("job_process", "ready") == "ready")
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            stop_server(self.server)
            self.server = None

    def close(self) -> None:
        self.stop()

    def own_floor(self, variant_id: str) -> float:
        """The variant floor of this variant's files, read where the store keeps them."""
        files = self.root / "store" / "variants" / variant_id / "files"
        seconds = variant_floor(files, self.root / "floor")
        shutil.rmtree(self.root / "floor", ignore_errors=True)
        return seconds


class Distributed:
    """The API and one Celery worker (processes of their own) with a private Redis and SeaweedFS S3.

    A restart is a new API and a new worker on the same Redis, bucket and worker cache directory."""

    mode: Mode = "distributed"
    # Heartbeats as the distributed tests set them: a stopped worker leaves /readyz within seconds.
    ENV = {"ENGRAM_HEARTBEAT_TTL_S": "3", "ENGRAM_RECONCILE_INTERVAL_S": "1"}

    def __init__(self, root: Path, model_root: Path) -> None:
        self.root, self.model_root = root, model_root
        self.redis: RedisServer = start_redis()
        # Room for GBs of statistics, engrams and variants (the tests' default holds 2 GB).
        self.seaweed: SeaweedServer = start_seaweed(root / "seaweed", volume_mb=1024, volumes=64)
        bucket = new_bucket(self.seaweed, "bench-e2e")
        self.store = S3Storage(self.seaweed.client(), bucket, "engram/")
        self.env = {
            "ENGRAM_BROKER_URL": self.redis.url,
            "ENGRAM_STORAGE_URL": f"s3://{bucket}/engram",
            "ENGRAM_S3_ENDPOINT_URL": self.seaweed.endpoint_url,
            **self.seaweed.env(),
            **self.ENV,
        }
        self.server: LiveServer | None = None
        self.worker: Any = None

    def start(self, name: str) -> LiveServer:
        env = {**self.env, "ENGRAM_CACHE_DIR": str(self.root / "cache" / "api")}
        self.server = start_server(self.root / "store", self.model_root, self.root / f"{name}-api.log", **env)
        worker_env = {**self.env, "ENGRAM_CACHE_DIR": str(self.root / "cache" / "worker")}
        self.worker = start_worker(
            server_env(self.root / "store", self.model_root, **worker_env), self.root / f"{name}-worker.log"
        )
        # Ready when every queue has a live worker (a 503 names the queues without one).
        _wait_ready(self.server, lambda code, body: code == 200 and bool(body.get("workers")))
        return self.server

    def stop(self) -> None:
        if self.worker is not None:
            kill_worker(self.worker, signal.SIGTERM)  # a warm shutdown: the worker says goodbye
            self.worker = None
        if self.server is not None:
            # The next API must not count the stopped worker as live: wait for its heartbeat to lapse.
            _wait_ready(self.server, lambda code, body: code == 503)
            stop_server(self.server)
            self.server = None

    def close(self) -> None:
        self.stop()
        stop_redis(self.redis)
        stop_seaweed(self.seaweed)

    def own_floor(self, variant_id: str) -> float:
        """The store floor: the variant's files (downloaded, untimed) copied and hashed, then
        uploaded to the same bucket, as the worker's own upload would."""
        files, out = self.root / "variant-files", self.root / "floor"
        prefix = f"variants/{variant_id}/files/"
        for key in self.store.list(prefix):
            target = files / key.removeprefix(prefix)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.store.download(key, target)
        started = time.perf_counter()
        variant_floor(files, out)
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            self.store.put_file(f"floor/{path.relative_to(out).as_posix()}", path)
        seconds = time.perf_counter() - started
        self.store.delete_prefix("floor/")
        shutil.rmtree(files, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        return seconds


def prepare(server: LiveServer, model_dir: Path, profile: Profile) -> list[str]:
    """Register the model, collect ``CONCEPTS`` concepts on it and build their universe."""
    api = server.client
    # A 202 from POST /models is the register job itself: post_and_wait waits for it either way.
    post_and_wait(api, "/models", {"model_id": MODEL_ID, "source": f"file://{model_dir}"}, 600, params={"wait": 60})
    names = []
    for k in range(CONCEPTS):
        records = [r.to_json() for r in text_records(profile.concept_records, profile.facts_per_record, seed=100 + k)]
        name = f"e2e-concept{k}"
        answer = api.post("/concepts", json={"name": name, "records": records, "models": [MODEL_ID]})
        if answer.status_code not in (200, 201, 202):
            raise RuntimeError(f"concept {name}: {answer.status_code} {answer.text}")
        names.append(name)
    wait_concepts_ready(api, names, MODEL_ID, timeout=1800)
    post_and_wait(api, f"/models/{MODEL_ID}/universes", {"concepts": names}, 3600)
    return names


def time_variant(server: LiveServer, concepts: list[str], alpha: float, phase: str) -> VariantTiming:
    """POST an unlearn of ``concepts`` and poll until it is ready; the client's wall time and the job's."""
    api = server.client
    started = time.perf_counter()
    answer = api.post(f"/models/{MODEL_ID}/unlearn", json={"concepts": concepts, "alpha": alpha})
    if answer.status_code != 202:
        raise RuntimeError(f"unlearn answered {answer.status_code} (a new variant must be built): {answer.text}")
    variant_id = answer.json()["variant"]["variant_id"]
    while True:
        variant = api.get(f"/variants/{variant_id}").json()
        if variant["status"] != "building":
            break
        time.sleep(POLL_S)
    wall = time.perf_counter() - started
    job = _finished_job(server, variant["job_id"])
    if variant["status"] != "ready":
        raise RuntimeError(f"variant {variant_id} failed: {job}")
    queued, run = _job_split(job)
    steps = (job.get("result") or {}).get("steps") or {}
    return VariantTiming(len(concepts), phase, wall, queued, run, {k: float(v) for k, v in steps.items()}, variant_id)


def _finished_job(server: LiveServer, job_id: str) -> dict[str, Any]:
    """The job once its record says it ended: a variant is ready when its manifest is published,
    a moment before its job's record (in another process) says ``succeeded``."""
    deadline = time.monotonic() + 30
    while True:
        job: dict[str, Any] = server.client.get(f"/jobs/{job_id}").json()
        if job.get("finished_at") or time.monotonic() > deadline:
            return job
        time.sleep(POLL_S)


def measure(profile: Profile, root: Path, reps: int, mode: Mode = "embedded") -> dict[str, Any]:
    model_root = root / "models"
    model_dir = build_model(profile, model_root / "llama")
    deployment = Embedded(root, model_root) if mode == "embedded" else Distributed(root, model_root)
    try:
        timings = _measure_on(deployment, profile, model_dir, root, reps)
    finally:
        deployment.close()
    copy_floor_s = statistics.median(t.copy_floor_s for t in timings)
    rows = []
    for phase in ("warm", "after restart"):
        for size in VARIANT_SIZES:
            picked = [t for t in timings if t.phase == phase and t.concepts == size]
            wall = statistics.median(t.wall_s for t in picked)
            own = statistics.median(t.own_floor_s for t in picked)
            rows.append(
                {
                    "phase": phase,
                    "concepts": size,
                    "wall_s": round(wall, 3),
                    "queued_s": _median_of([t.queued_s for t in picked]),
                    "job_run_s": _median_of([t.run_s for t in picked]),
                    "copy_floor_s": round(copy_floor_s, 3),
                    "ratio": round(wall / copy_floor_s, 2),
                    "own_floor": "variant floor" if mode == "embedded" else "store floor",
                    "own_floor_s": round(own, 3),
                    "own_ratio": round(wall / own, 2),
                    "goal": GOALS[size] if phase == "after restart" else None,
                    "steps": _median_steps([t.steps for t in picked]),
                    "walls_s": [round(t.wall_s, 3) for t in picked],
                }
            )
    return {
        "profile": profile.name,
        "mode": mode,
        "floors_s": [round(t.copy_floor_s, 3) for t in timings],
        "own_floors_s": [round(t.own_floor_s, 3) for t in timings],
        "rows": rows,
    }


def _measure_on(
    deployment: Embedded | Distributed, profile: Profile, model_dir: Path, root: Path, reps: int
) -> list[VariantTiming]:
    """Variants of every size, warm then each after a restart, with the floors after each."""
    timings: list[VariantTiming] = []
    server = deployment.start("first")
    names = prepare(server, model_dir, profile)
    alpha = 1.0
    for _ in range(reps):
        for size in VARIANT_SIZES:
            alpha -= 0.001
            timings.append(_with_floors(time_variant(server, names[:size], alpha, "warm"), deployment, model_dir, root))
    deployment.stop()
    for rep in range(reps):
        for size in VARIANT_SIZES:
            # A fresh service per measurement: each is "the first variant after a restart".
            server = deployment.start(f"restart-{rep}-{size}")
            alpha -= 0.001
            timing = time_variant(server, names[:size], alpha, "after restart")
            deployment.stop()
            timings.append(_with_floors(timing, deployment, model_dir, root))
    return timings


def _with_floors(timing: VariantTiming, deployment: Embedded | Distributed, model_dir: Path, root: Path) -> VariantTiming:
    timing.copy_floor_s = _copy_floor(model_dir, root)
    timing.own_floor_s = deployment.own_floor(timing.variant_id)
    return timing


def _copy_floor(model_dir: Path, root: Path) -> float:
    seconds = copy_floor(model_dir, root / "floor")
    shutil.rmtree(root / "floor", ignore_errors=True)
    return seconds


def run(profile_name: str, reps: int, keep: Path | None = None, mode: Mode = "embedded") -> dict[str, Any]:
    """Measure one profile (a temporary folder unless ``keep``); the result with the load averages."""
    root = keep or Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    try:
        result = measure(PROFILES[profile_name], root, reps, mode)
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    result["environment"] = {
        **environment(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    return result


def _median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def _median_steps(all_steps: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for steps in all_steps for name in steps})
    return {name: round(statistics.median(s.get(name, 0.0) for s in all_steps), 3) for name in names}


def table(result: dict[str, Any]) -> str:
    load = result.get("environment", {})
    first = result["rows"][0]
    own = first.get("own_floor", "variant floor")
    lines = [
        f"variants through the HTTP API, {result['profile']}, {result.get('mode', 'embedded')} "
        f"(POST to ready, median; copy floor {first['copy_floor_s']} s, {own} {first.get('own_floor_s', '?')} s; "
        f"load average {load.get('loadavg_start', '?')} -> {load.get('loadavg_end', '?')})",
        f"{'phase':<14} {'concepts':>8} {'wall s':>8} {'queued s':>9} {'job s':>7} {'× copy':>7} "
        f"{'× ' + own.split()[0]:>10} {'goal':>6}",
    ]
    for row in result["rows"]:
        goal = f"≤{row['goal']}" if row["goal"] else ""
        queued = "" if row["queued_s"] is None else f"{row['queued_s']:.3f}"
        run = "" if row["job_run_s"] is None else f"{row['job_run_s']:.3f}"
        own_ratio = row.get("own_ratio")
        lines.append(
            f"{row['phase']:<14} {row['concepts']:>8} {row['wall_s']:>8.3f} {queued:>9} {run:>7} "
            f"{row['ratio']:>7.2f} {'' if own_ratio is None else f'{own_ratio:.2f}':>10} {goal:>6}"
        )
        if row["steps"]:
            lines.append("    steps: " + ", ".join(f"{k} {v:.3f}" for k, v in row["steps"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="100m")
    parser.add_argument("--reps", type=int, default=3, help="variants of each size per phase (median reported)")
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument(
        "--mode",
        choices=["embedded", "distributed"],
        default="embedded",
        help="embedded job process on file storage, or API + Celery worker + Redis + S3 (SeaweedFS)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="result file (default bench/results/e2e-PROFILE[-distributed].json)"
    )
    args = parser.parse_args(argv)
    result = run(args.profile, args.reps, args.keep, args.mode)
    suffix = "" if args.mode == "embedded" else f"-{args.mode}"
    out = args.json or REPO / "bench" / "results" / f"e2e-{args.profile}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"(written to {out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
