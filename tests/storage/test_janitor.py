"""Crash leftovers are removed when a process starts (service.storage.janitor), and nothing live is; the
API's janitor applies the universes' retention rule at start-up and periodically.

Leftovers are made by hand, named the way the service names them, for owners that are dead, alive,
or whose pid now belongs to a younger process; then the real server (and a real Celery worker)
starts with ``TMPDIR`` and ``ENGRAM_CACHE_DIR`` pointing at them. Universes are made by hand too,
as a build stores them (request, parts, manifest, usage record), used long ago or recently.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from engram_fixtures.live import (
    REPO_ROOT,
    server_env,
    start_redis,
    start_server,
    start_worker,
    stop_redis,
    stop_server,
)
from service.config import Settings
from service.context import Context
from service.engrams.manifest import UNIVERSE_FORMAT
from service.jobs.store import JobStore
from service.storage.base import HOST_TAG
from service.storage.janitor import clean_leftovers
from service.storage.s3 import S3Storage
from service.universes.holdings import effective_budget
from tests.helpers.s3 import SeaweedServer

DAY_AGO = time.time() - 24 * 3600
OTHER_HOST = "ffffffff" if HOST_TAG != "ffffffff" else "eeeeeeee"


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    return int(done.stdout)


def age(path: Path, when: float = DAY_AGO) -> Path:
    """Set the modification time of ``path`` and of everything below it to ``when``."""
    for item in [*path.rglob("*"), path] if path.is_dir() else [path]:
        os.utime(item, (when, when))
    return path


def folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"x" * 100)
    return path


def file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"y" * 100)
    return path


@dataclass
class Leftovers:
    removed: list[Path]  # must be gone after the sweep
    kept: list[Path]  # must still be there


@pytest.fixture
def live_owner(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A running process holding a scratch folder made by ``service.storage.base.scratch_dir``."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = (
        "import time\nfrom service.storage.base import scratch_dir\n"
        "d = scratch_dir('live')\nprint(d.name, flush=True)\ntime.sleep(600)"
    )
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield process, Path(process.stdout.readline().strip())
    finally:
        process.kill()
        process.wait()


def make_leftovers(root: Path, live: subprocess.Popen[str], live_scratch: Path) -> Leftovers:
    tmp, cache, store = root / "tmp", root / "cache", root / "store"
    dead = dead_pid()
    removed = [
        folder(tmp / f"engram-stats.{dead}.{HOST_TAG}.abcdefgh"),  # its process is gone
        folder(tmp / f"engram-upload.{dead}.{HOST_TAG}.k2j3h4g5"),
        # the live process's pid, but the folder is older than that process: the pid was reused
        age(folder(tmp / f"engram-variant.{live.pid}.{HOST_TAG}.zzzzzzzz"), time.time() - 3600),
        age(folder(tmp / "engram-variant-a1b2c3d4")),  # named before owners were, stale
        age(folder(cache / "s3" / ".partial-q8w7e6r5")),  # a model download that stopped a day ago
        age(file(cache / "stats" / f".{'a' * 40}.safetensors.{dead}.140000000000.part")),
        age(file(cache / "stats" / f".{'b' * 40}.safetensors.{dead}.140000000000.download")),
        file(store / ".tmp" / f"{dead}.{HOST_TAG}.{uuid.uuid4().hex}"),  # a half-written object
        age(file(store / ".tmp" / uuid.uuid4().hex)),  # named before owners were, stale
    ]
    kept = [
        live_scratch,  # in use by a running process
        file(store / ".tmp" / f"{live.pid}.{HOST_TAG}.{uuid.uuid4().hex}"),
        folder(tmp / f"engram-stats.{dead}.{OTHER_HOST}.abcdefgh"),  # another machine's, recent
        folder(tmp / "engram-variant-recent12"),  # no owner, recent
        folder(cache / "s3" / ".partial-recent12"),  # a download in progress
        age(folder(cache / "s3" / ("c" * 64))),  # a finished download, however old
        age(file(cache / "stats" / f"{'d' * 40}.safetensors")),  # a cached statistics file
        age(folder(tmp / "engram-metrics-a1b2c3d4")),  # a worker's Prometheus folder: not ours to judge
        age(folder(tmp / "someone-else-a1b2c3d4")),
    ]
    return Leftovers(removed, kept)


def wait_swept(leftovers: Leftovers, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(p.exists() for p in leftovers.removed):
        if time.monotonic() > deadline:
            raise AssertionError(f"still there: {[p for p in leftovers.removed if p.exists()]}\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def test_api_start_removes_dead_processes_leftovers_only(
    tmp_path: Path, model_root: Path, live_owner: tuple[subprocess.Popen[str], Path]
) -> None:
    live, live_scratch = live_owner
    leftovers = make_leftovers(tmp_path, live, live_scratch)
    env = {"TMPDIR": str(tmp_path / "tmp"), "ENGRAM_CACHE_DIR": str(tmp_path / "cache"), "ENGRAM_TASK_HARD_LIMIT_S": "3600"}
    server = start_server(tmp_path / "store", model_root, tmp_path / "server.log", **env)
    try:
        wait_swept(leftovers, server.log_path)
        deadline = time.monotonic() + 30
        while "start-up sweep done" not in server.log_tail(100_000):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        assert server.client.get("/healthz").status_code == 200
    finally:
        stop_server(server)
    assert [p for p in leftovers.kept if not p.exists()] == []
    assert live.poll() is None


def test_worker_start_removes_dead_processes_leftovers_only(
    tmp_path: Path, model_root: Path, live_owner: tuple[subprocess.Popen[str], Path]
) -> None:
    live, live_scratch = live_owner
    leftovers = make_leftovers(tmp_path, live, live_scratch)
    redis = start_redis()
    env = server_env(
        tmp_path / "store",
        model_root,
        ENGRAM_BROKER_URL=redis.url,
        TMPDIR=str(tmp_path / "tmp"),
        ENGRAM_CACHE_DIR=str(tmp_path / "cache"),
        ENGRAM_TASK_HARD_LIMIT_S="3600",
    )
    log = tmp_path / "worker.log"
    worker = start_worker(env, log)
    try:
        wait_swept(leftovers, log)
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(timeout=30)
        stop_redis(redis)
    assert [p for p in leftovers.kept if not p.exists()] == []


def test_unfinished_s3_multipart_uploads_are_aborted(
    seaweed: SeaweedServer, s3_bucket: str, s3_env: SeaweedServer, tmp_path: Path
) -> None:
    storage = S3Storage(seaweed.client(), s3_bucket, "janitor/")
    client = seaweed.client()
    crashed = client.create_multipart_upload(Bucket=s3_bucket, Key="janitor/variants/v/files/model.safetensors")
    client.upload_part(
        Bucket=s3_bucket,
        Key="janitor/variants/v/files/model.safetensors",
        UploadId=crashed["UploadId"],
        PartNumber=1,
        Body=b"z" * 1024,
    )
    outside = client.create_multipart_upload(Bucket=s3_bucket, Key="elsewhere/object")  # not under the prefix
    settings = Settings(storage_url=f"s3://{s3_bucket}/janitor", cache_dir=tmp_path / "cache")

    assert clean_leftovers(settings, storage).removed == []  # younger than the visibility timeout: kept
    sweep = clean_leftovers(settings, storage, stale_after_s=0)
    assert sweep.removed == [f"1 unfinished upload(s) in {storage!r}"]
    uploads = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [outside["UploadId"]]
    client.abort_multipart_upload(Bucket=s3_bucket, Key="elsewhere/object", UploadId=outside["UploadId"])


# ---------------------------------------------------------------- the universes' retention rule


def stored_universe(store: Path, universe_id: str, *, days_ago: float, current_of: str | None = None) -> Path:
    """A built universe as the build stores it (two groups, one member), last used ``days_ago``;
    ``current_of``: the current universe of that model. Returns its folder."""
    folder = store / "universes" / universe_id
    used = (datetime.now(timezone.utc) - timedelta(days=days_ago)).isoformat()
    request: dict[str, object] = {
        "format_version": 1,
        "universe_id": universe_id,
        "model_id": "m",
        "model_digest": "d",
        "members": [],
        "stats": [],
        "rcond": None,
    }
    write_json(folder / "request.json", {**request, "job_id": None, "created_at": used})
    write_json(folder / "usage.json", {"last_used": used})
    write_json(folder / "plan.json", {"groups": {}, "layers": []})
    parts = {"groups/g1.safetensors": 300, "groups/g2.safetensors": 200, "engrams/k.safetensors": 500}
    for name, size in parts.items():
        file(folder / name).write_bytes(b"z" * size)
    write_json(folder / "engrams/k.json", {"bytes": 500})
    manifest = {  # as the build writes it (service.engrams.manifest.UniverseManifest), no groups or layers
        "format": UNIVERSE_FORMAT,
        "universe_id": universe_id,
        "model_id": "m",
        "model_digest": "d",
        "rcond": None,
        "members": [],
        "groups": {},
        "layers": {},
        "engrams": {"k": {"bytes": 500, "norms": {}}},
        "bytes": {"groups": 500, "engrams": 500, "total": 1000},
        "seconds": {},
        "created_at": used,
    }
    write_json(folder / "manifest.json", manifest)
    file(store / "model-universes" / "m" / "known" / universe_id).write_bytes(b"")
    if current_of is not None:
        pointer = {
            "universe_id": universe_id,
            "members": {},
            "rcond": None,
            "since": "2026-11-01T00:00:00Z",
        }  # as set_current writes it
        write_json(store / "model-universes" / current_of / "current.json", pointer)
    return folder


def write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def evicted(folder: Path) -> bool:
    """Only the request and the usage record (now saying when) are left."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return names == ["request.json", "usage.json"] and json.loads((folder / "usage.json").read_text())["evicted_at"]


def test_the_api_janitor_evicts_unused_universes_at_start_up_and_periodically(tmp_path: Path, model_root: Path) -> None:
    store = tmp_path / "store"
    old = stored_universe(store, "a" * 32, days_ago=30)
    current = stored_universe(store, "b" * 32, days_ago=30, current_of="m")
    recent = stored_universe(store, "c" * 32, days_ago=0)
    env = {
        "ENGRAM_UNIVERSE_RETENTION_S": str(86400),
        "ENGRAM_JANITOR_INTERVAL_S": "0.5",
        "ENGRAM_CACHE_DIR": str(tmp_path / "cache"),
    }
    server = start_server(store, model_root, tmp_path / "server.log", **env)
    try:
        deadline = time.monotonic() + 30
        while not evicted(old):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        later = stored_universe(store, "d" * 32, days_ago=2)  # falls out of use after start-up
        while not evicted(later):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        time.sleep(1.5)  # a few more passes
        view = server.client.get(f"/universes/{'a' * 32}").json()
        assert (view["status"], view["bytes"]) == ("evicted", 0)
        usage = server.client.get("/universes/usage").json()
        assert usage["bytes"]["total"] == 2 * 1000 and usage["universes"]["evicted"] == 2
    finally:
        stop_server(server)
    assert not evicted(current) and (current / "manifest.json").exists(), "a model's current universe is kept"
    assert not evicted(recent) and (recent / "engrams/k.safetensors").exists(), "used within the retention age"
    assert json.loads((old / "usage.json").read_text())["evicted_bytes"] == 1000


# ---------------------------------------------------------------- the universe budget against the volume


def test_the_api_start_caps_a_universe_budget_larger_than_the_volume(tmp_path: Path, model_root: Path) -> None:
    """Issue 23, finding 6: the budget (256 GiB by default) was never checked against the disk. The
    janitor's start-up pass warns that the budget in force is ENGRAM_UNIVERSE_VOLUME_FRACTION of the
    store's volume, and GET /universes/usage shows both budgets."""
    store = tmp_path / "store"
    store.mkdir()
    env = {"ENGRAM_UNIVERSE_BYTES_BUDGET": str(1 << 60), "ENGRAM_CACHE_DIR": str(tmp_path / "cache")}
    server = start_server(store, model_root, tmp_path / "server.log", **env)
    try:
        deadline = time.monotonic() + 30
        while "ENGRAM_UNIVERSE_VOLUME_FRACTION" not in server.log_tail(100_000):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        usage = server.client.get("/universes/usage").json()
    finally:
        stop_server(server)
    disk = shutil.disk_usage(store)
    assert usage["configured_budget_bytes"] == 1 << 60
    assert abs(usage["budget_bytes"] - (disk.used + disk.free) // 2) < (disk.used + disk.free) // 100
    assert usage["volume_bytes"] and "ENGRAM_UNIVERSE_VOLUME_FRACTION=0.5" in usage["budget_note"]


def test_s3_storage_has_no_volume_and_says_so(seaweed: SeaweedServer, s3_bucket: str, tmp_path: Path) -> None:
    settings = Settings(storage_url=f"s3://{s3_bucket}/budget", cache_dir=tmp_path / "cache", universe_bytes_budget=1 << 60)
    storage = S3Storage(seaweed.client(), s3_bucket, "budget/")
    jobs = JobStore(storage)
    ctx = Context(settings=settings, storage=storage, jobs=jobs, dispatch=lambda job: None, lock=threading.RLock())
    budget = effective_budget(ctx)
    assert (budget.bytes, budget.volume) == (1 << 60, None), "nothing to cap an object store's budget to"
    assert budget.note is not None and "no volume" in budget.note
