"""Lifecycle at the wrong moment, from the outside: a store that fills up or turns read-only.

A real server (embedded mode) keeps its storage on a small tmpfs of its own, so the disk really
fills and really becomes read-only; mounting one needs root (CAP_SYS_ADMIN), so without it the
module is skipped (``tests/storage/test_local_storage_full.py`` covers the same errors without a mount).
A full or read-only store is the operator's to fix: the answer is the documented 503 with
``Retry-After`` naming the cause (as ``/readyz`` does), never a 500, and nothing the request began
stays half-done.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.demo import make_facts
from tests.api.test_api import assert_problem
from tests.live import LiveServer, running_server, wait_concepts_ready, wait_for_job

MODEL = "sweep/tiny"
STORE_BYTES = 4 << 20
RECORDS = [{"prompt": p, "completion": c} for p, c in make_facts(12, seed=5)]


def _mount(where: Path, *options: str) -> bool:
    command = ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)]
    try:
        return subprocess.run(command, capture_output=True, check=False).returncode == 0
    except OSError:
        return False


def _remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("small-disk")
    if not _mount(where, f"size={STORE_BYTES}"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


@pytest.fixture(scope="module")
def server(
    small_disk: Path, tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, model_root: Path
) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("sweep")
    (root / "store").symlink_to(small_disk)  # the server's storage is the small disk
    with running_server(root, model_root, ENGRAM_CACHE_DIR=str(root / "cache")) as live:
        assert live.client.post("/models", json={"model_id": MODEL, "source": f"file://{tiny_llama_dir}"}).status_code == 201
        assert live.client.post("/concepts", json={"name": "kept", "models": [MODEL], "records": RECORDS}).status_code == 202
        wait_concepts_ready(live.client, ["kept"], MODEL)
        yield live


def _fill(disk: Path, leave_bytes: int) -> Path:
    """Fill ``disk`` up to ``leave_bytes`` free; returns the filler file (delete it to free the space)."""
    filler = disk / "filler"
    with filler.open("wb") as handle:
        try:
            while True:
                free = _free_bytes(disk)
                if free <= leave_bytes:
                    break
                handle.write(b"\0" * min(1 << 20, free - leave_bytes))
                handle.flush()
        except OSError:
            pass
    return filler


def _free_bytes(disk: Path) -> int:
    stat = os.statvfs(disk)
    return stat.f_bavail * stat.f_frsize


def test_a_full_store_is_a_503_naming_it_and_changes_nothing(server: LiveServer, small_disk: Path) -> None:
    api = server.client
    filler = _fill(small_disk, 0)
    try:
        answer = api.post("/concepts", json={"name": "no-room", "models": [MODEL], "records": RECORDS})
        assert_problem(answer, 503)
        assert "No space left on device" in answer.json()["detail"], answer.text
        assert answer.headers["Retry-After"]
        assert api.get("/concepts/no-room").status_code == 404
        assert api.get("/healthz").status_code == 200  # the connection and the process are fine
    finally:
        filler.unlink()
    answer = api.post("/concepts", json={"name": "no-room", "models": [MODEL], "records": RECORDS})
    assert answer.status_code == 202, answer.text  # space freed: the same request goes through


def test_statistics_that_do_not_fit_fail_the_job_naming_the_full_disk(server: LiveServer, small_disk: Path) -> None:
    api = server.client
    filler = _fill(small_disk, 64 << 10)  # room for the request's documents, not for the statistics
    try:
        records = [{"prompt": p, "completion": c} for p, c in make_facts(12, seed=6)]
        answer = api.post("/concepts", json={"name": "too-big", "models": [MODEL], "records": records})
        assert answer.status_code == 202, answer.text
        job = wait_for_job(api, answer.json()["jobs"][0]["job_id"])
        assert job["status"] == "failed"
        assert job["error"]["status"] != 500, job["error"]
        assert "No space left on device" in job["error"]["detail"], job["error"]
        assert api.get("/concepts/too-big").json()["models"][MODEL]["status"] == "failed"
    finally:
        filler.unlink()


def test_a_read_only_store_is_a_503_naming_it_and_changes_nothing(server: LiveServer, small_disk: Path) -> None:
    api = server.client
    _remount(small_disk, "ro")
    try:
        writes = [
            api.post("/concepts", json={"name": "read-only", "models": [MODEL], "records": RECORDS}),
            api.delete("/concepts/kept"),
            api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["kept"], "alpha": 0.25}),
        ]
        for answer in writes:
            assert_problem(answer, 503)
            assert "Read-only file system" in answer.json()["detail"], answer.text
        assert api.get("/concepts/read-only").status_code == 404
        assert api.get("/concepts/kept").json()["models"][MODEL]["status"] == "ready"
    finally:
        _remount(small_disk, "rw")
    assert api.delete("/concepts/kept").status_code == 204


def test_a_refused_write_leaves_the_connection_usable(server: LiveServer, small_disk: Path) -> None:
    """An unhandled error makes uvicorn close a kept-alive connection under the client's next request."""
    _remount(small_disk, "ro")
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            assert client.post("/concepts", json={"name": "x", "models": [MODEL], "records": RECORDS}).status_code == 503
            assert client.get("/healthz").status_code == 200
    finally:
        _remount(small_disk, "rw")
