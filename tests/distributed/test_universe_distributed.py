"""A universe built by several workers, against real processes: a private redis-server, the API and
two Celery workers sharing one storage directory (``tests.distributed.cluster``).

- Two workers decompose one universe's input groups in parallel, each group once: every worker logs
  each part it computes (``universe <id>: group <g> decomposed ... by host:pid``) and records it
  (``parts/group-<g>.json``); across both logs every group appears exactly once, and both workers
  computed some.
- A worker killed (SIGKILL) while it holds a group's lease, a helper or the one running the job: the
  lease expires (``ENGRAM_HEARTBEAT_TTL_S`` is 3 s here; the job's heartbeat too, and the reconciler
  dispatches it again), another worker computes that group, and the universe equals one built in this
  process from a copy of the same storage without any kill: factors to 1e-9 relative (float64 on both
  sides; only the threads' summation order differs), engrams to 1e-6 relative (stored float32: the
  float64 products round to the same float32 values but for an ulp here and there, 6e-8 each).
- A fresh worker (its own cache directory, a new process, no other worker alive) serves a variant of
  the built universe: it logs no decomposition and no engram, and no stored part changes.

The model is a tiny Llama wide enough (hidden 384, MLP 768, 4 layers: 17 input groups, ``eigh`` of
768 x 768 about 0.1 s) that a decomposition lasts long enough to share and to be killed in, and
the concepts hold more tokens than any group is wide, so every group is an ``eigh`` (``D³``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch
from safetensors import safe_open

from engram_fixtures.demo import make_facts
from engram_fixtures.live import kill_worker, wait_for_job
from engram_fixtures.models import make_tiny_llama
from service.config import Settings
from service.context import Context
from service.jobs.store import JobStore
from service.storage.keys import engram_key, group_key, universe_prefix
from service.storage.local import LocalStorage
from service.universes.build import ensure_universe
from service.universes.factors import load_factors
from tests.distributed.cluster import Cluster

MODEL = "dist/wide"
FACTS = make_facts(60, seed=21)
CONCEPTS = {f"wide-{i}": [{"text": p + c} for p, c in FACTS[i * 14 : (i + 1) * 14]] for i in range(3)}
FACTOR_TOL = 1e-9
ENGRAM_TOL = 1e-6
DECOMPOSED = re.compile(r"universe (\w+): group (\S+) decomposed from (\w+) by (\S+):(\d+) ")
ENGRAMS = re.compile(r"universe (\w+): engrams of member (\S+) written by (\S+):(\d+) ")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("dist-universe")
    make_tiny_llama(root / "models" / "wide", hidden=384, layers=4)
    # One thread per process: two workers and the API share this machine's cores (OpenMP threads
    # spinning against each other made each decomposition ~50x slower on a busy 2-core box).
    cluster = Cluster(root, ENGRAM_COLLECT_BATCH_SIZE="8", OMP_NUM_THREADS="1")
    try:
        cluster.start_worker()
        cluster.start_worker()
        client = cluster.api.client
        response = client.post("/models", json={"model_id": MODEL, "source": f"file://{root / 'models' / 'wide'}"})
        assert response.status_code == 201, response.text
        jobs = []
        for name, records in CONCEPTS.items():
            posted = client.post("/concepts", json={"name": name, "models": [MODEL], "records": records})
            assert posted.status_code == 202, posted.text
            jobs.append(posted.json()["jobs"][0]["job_id"])
        for job_id in jobs:
            assert wait_for_job(client, job_id, timeout=300)["status"] == "succeeded"
        yield cluster
    finally:
        cluster.close()


def build_universe(client: httpx.Client, rcond: float) -> tuple[str, str]:
    """POST a universe of the three concepts; returns (universe ID, its job ID)."""
    response = client.post(f"/models/{MODEL}/universes", json={"concepts": sorted(CONCEPTS), "rcond": rcond})
    assert response.status_code == 202, response.text
    return response.json()["universe"]["universe_id"], response.json()["job"]["job_id"]


def logged_parts(cluster: Cluster, universe_id: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(group, pid) for every group decomposition and (member, pid) for every member's engrams that
    the workers' logs record for this universe."""
    groups, members = [], []
    for log in sorted(cluster.root.glob("worker-*.log")):
        text = log.read_text(errors="replace")
        groups += [(m[2], int(m[5])) for m in DECOMPOSED.finditer(text) if m[1] == universe_id]
        members += [(m[2], int(m[4])) for m in ENGRAMS.finditer(text) if m[1] == universe_id]
    return groups, members


def worker_of(cluster: Cluster, pid: int) -> int:
    """The index of the worker (a process group: its main process and pool children) ``pid`` is in."""
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        group = -1
    found = [i for i, w in enumerate(cluster.workers) if w.pid in (pid, group)]
    assert found, f"pid {pid} is no worker's"
    return found[0]


def manifest(cluster: Cluster, universe_id: str) -> dict[str, Any]:
    return json.loads((cluster.storage / universe_prefix(universe_id) / "manifest.json").read_text())


def test_two_workers_decompose_one_universe_in_parallel_each_group_once(cluster: Cluster) -> None:
    client = cluster.api.client
    universe_id, job_id = build_universe(client, rcond=1e-5)
    job = wait_for_job(client, job_id, timeout=300)
    assert job["status"] == "succeeded", job
    built = manifest(cluster, universe_id)
    groups, members = logged_parts(cluster, universe_id)
    decomposed = sorted(g for g, _ in groups)
    assert decomposed == sorted(built["groups"]), "every group decomposed exactly once, by one worker"
    assert sorted(m for m, _ in members) == sorted(built["engrams"]), "every member's engrams written once"
    by_worker = {worker_of(cluster, pid) for _, pid in groups}
    assert by_worker == {0, 1}, f"both workers decomposed groups: {groups}"
    # The records agree with the logs: who computed each group, from the sums (eigh), as the manifest says.
    for group, pid in groups:
        info = built["groups"][group]
        assert info["worker"].endswith(f":{pid}") and info["source"] == "sums", (group, info)
    assert job["progress"]["done"] == job["progress"]["total"] == len(built["groups"]) + len(built["layers"]) * 3
    print(  # noqa: T201 - the note's figure
        f"\n{len(groups)} groups: {sum(worker_of(cluster, p) == 0 for _, p in groups)} by worker 0, "
        f"{sum(worker_of(cluster, p) == 1 for _, p in groups)} by worker 1; members by "
        f"{sorted(worker_of(cluster, p) for _, p in members)}; build {built['seconds']}"
    )


@pytest.mark.parametrize(("role", "rcond"), [("helper", 1e-4), ("coordinator", 2e-4)])
def test_a_worker_killed_holding_a_group_is_recovered(cluster: Cluster, tmp_path: Path, role: str, rcond: float) -> None:
    """``helper``: the job takes the group over once the lease expires. ``coordinator``: the worker
    running the job dies; the reconciler re-dispatches the job when its heartbeat expires, and the
    group is taken over (by the helper, or the job run again) once its lease expires."""
    client = cluster.api.client
    leases = redis.Redis.from_url(cluster.redis.url)
    universe_id, job_id = build_universe(client, rcond=rcond)
    coordinator = wait_for_coordinator(cluster, universe_id)
    victim, group, killed_pid = wait_for_lease(cluster, leases, universe_id, coordinator, role)
    kill_worker(cluster.workers[victim])
    killed_at = time.monotonic()
    cluster.start_worker()
    job = wait_for_job(client, job_id, timeout=300)
    recovered_s = time.monotonic() - killed_at
    assert job["status"] == "succeeded", job
    built = manifest(cluster, universe_id)
    computed_by = int(built["groups"][group]["worker"].rsplit(":", 1)[1])
    assert computed_by != killed_pid, f"group {group} was published by the killed worker before it died (a race)"
    groups, _ = logged_parts(cluster, universe_id)
    assert sorted(g for g, _ in groups) == sorted(built["groups"]), "each group decomposed once, the lost one included"
    assert not leases.keys(f"engram:lease:universe:{universe_id}:*"), "no lease outlives the build"
    print(f"\n{role} SIGKILLed holding group {group}: universe done {recovered_s:.1f}s later")  # noqa: T201
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run (OMP_NUM_THREADS=1): 2 threads were 10x slower on a busy box
    try:
        reference = reference_build(cluster, universe_id, tmp_path)
        assert_same_universe(cluster.storage, reference, built)
    finally:
        torch.set_num_threads(previous)


def test_a_fresh_worker_serves_a_variant_from_stored_engrams_without_decomposing(cluster: Cluster) -> None:
    client = cluster.api.client
    universe_id, job_id = build_universe(client, rcond=1e-3)
    assert wait_for_job(client, job_id, timeout=300)["status"] == "succeeded"
    before = stored_parts(cluster, universe_id)
    for worker in cluster.workers:
        kill_worker(worker)
    fresh = cluster.start_worker()  # its own ENGRAM_CACHE_DIR, nothing in memory
    fresh_log = cluster.root / f"worker-{len(cluster.workers) - 1}.log"
    variant = client.post(f"/models/{MODEL}/unlearn", json={"concepts": ["wide-0"], "universe": universe_id})
    assert variant.status_code == 202, variant.text
    assert variant.json()["variant"]["universe_id"] == universe_id
    job = wait_for_job(client, variant.json()["job"]["job_id"], timeout=300)
    assert job["status"] == "succeeded", job
    assert job["result"]["universe_built_s"] is None, "the universe was built already"
    assert worker_of(cluster, int(job["result"]["worker"].rsplit(":", 1)[1])) == cluster.workers.index(fresh)
    text = fresh_log.read_text(errors="replace")
    assert "decomposed from" not in text and "engrams of member" not in text, "the fresh worker computed nothing"
    assert stored_parts(cluster, universe_id) == before, "no stored part of the universe was written again"


# ---------------------------------------------------------------- helpers


def wait_for_coordinator(cluster: Cluster, universe_id: str, timeout: float = 120) -> int:
    """The index of the worker running the universe job (it logs ``building universe <id>``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i in range(len(cluster.workers)):
            log = cluster.root / f"worker-{i}.log"
            if log.exists() and f"building universe {universe_id}" in log.read_text(errors="replace"):
                return i
        time.sleep(0.02)
    raise AssertionError("no worker started the universe job")


def wait_for_lease(
    cluster: Cluster, leases: redis.Redis, universe_id: str, coordinator: int, role: str, timeout: float = 120
) -> tuple[int, str, int]:
    """(worker index, group, pid) as soon as the coordinator (``role``), or another worker, holds a group's lease."""
    prefix = f"engram:lease:universe:{universe_id}:group:"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for key in leases.keys(prefix + "*"):
            token = leases.get(key)
            if token is None:
                continue
            pid = int(token.decode().rsplit(":", 2)[1])
            worker = worker_of(cluster, pid)
            if (worker == coordinator) == (role == "coordinator"):
                return worker, key.decode().removeprefix(prefix), pid
        assert not (cluster.storage / universe_prefix(universe_id) / "manifest.json").exists(), (
            f"the universe was built before the {role} held a group"
        )
        time.sleep(0.01)
    raise AssertionError(f"the {role} held no group's lease")


def stored_parts(cluster: Cluster, universe_id: str) -> dict[Path, int]:
    """Modification times of the universe's computed parts (factors, engrams, their records, manifest)."""
    folder = cluster.storage / universe_prefix(universe_id)
    files = [folder / "manifest.json", *(p for sub in ("groups", "engrams", "parts") for p in (folder / sub).rglob("*"))]
    return {p: p.stat().st_mtime_ns for p in files if p.is_file()}


def reference_build(cluster: Cluster, universe_id: str, root: Path) -> Path:
    """The same universe built here, in one process, from a copy of the storage without its parts."""
    store = root / "store"
    shutil.copytree(cluster.storage, store, ignore=shutil.ignore_patterns(".tmp", "jobs"))
    folder = store / universe_prefix(universe_id)
    for part in folder.iterdir():
        if part.name != "request.json":
            shutil.rmtree(part) if part.is_dir() else part.unlink()
    settings = Settings(storage_url=f"file://{store}", model_roots=str(cluster.models), cache_dir=root / "cache")
    storage = LocalStorage(store)
    ctx = Context(settings=settings, storage=storage, jobs=JobStore(storage), dispatch=None, lock=None)
    ensure_universe(ctx, universe_id)
    return store


def assert_same_universe(store: Path, reference: Path, built: dict[str, Any]) -> None:
    uid = built["universe_id"]
    eye: dict[int, torch.Tensor] = {}
    for group, info in built["groups"].items():
        ours = load_factors(store / group_key(uid, group))
        theirs = load_factors(reference / group_key(uid, group))
        assert ours.rank == theirs.rank == info["rank"], group
        identity = eye.setdefault(info["dim"], torch.eye(info["dim"], dtype=torch.float64))
        assert rel(ours.apply_right(identity), theirs.apply_right(identity)) < FACTOR_TOL, group
    for member in built["engrams"]:
        with (
            safe_open(str(store / engram_key(uid, member)), framework="pt") as ours,
            safe_open(str(reference / engram_key(uid, member)), framework="pt") as theirs,
        ):
            for layer in built["layers"]:
                assert rel(ours.get_tensor(layer).double(), theirs.get_tensor(layer).double()) < ENGRAM_TOL, layer


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())
