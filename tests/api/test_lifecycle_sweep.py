"""Lifecycle at the wrong moment, from the outside: a store that fills up or turns read-only.

A real server (embedded mode) keeps its storage in a folder of its own. A disk that is really full
or read-only can only be made with a mount, which needs root, so the kernel's refusal is stood in
for: the server starts with ``tests/api/refusing_store`` on its ``PYTHONPATH``, whose
``sitecustomize`` makes the store's publishing and deleting calls raise the ``OSError`` a full
(``ENOSPC``) or read-only (``EROFS``) disk raises while a flag file says so (the only thing mocked;
``tests/storage/test_local_storage_full.py`` checks each errno against the store itself).
A full or read-only store is the operator's to fix: the answer is the documented 503 with
``Retry-After`` naming the cause (as ``/readyz`` does), never a 500, and nothing the request began
stays half-done.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import REPO_ROOT, LiveServer, running_server, wait_concepts_ready, wait_for_job
from tests.helpers.api import assert_problem, register_model

MODEL = "sweep/tiny"
RECORDS = [{"prompt": p, "completion": c} for p, c in make_facts(12, seed=5)]
INJECTOR = Path(__file__).parent / "refusing_store"


@pytest.fixture(scope="module")
def flag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """While this file exists, the server's store refuses writes as its content says."""
    return tmp_path_factory.mktemp("refusals") / "refuse"


@pytest.fixture(scope="module")
def server(
    flag: Path, tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, model_root: Path
) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("sweep")
    refusing = {
        "PYTHONPATH": f"{INJECTOR}:{REPO_ROOT}",
        "ENGRAM_TEST_REFUSE_FLAG": str(flag),
        "ENGRAM_TEST_REFUSED_ROOT": str(root / "store"),
    }
    with running_server(root, model_root, ENGRAM_CACHE_DIR=str(root / "cache"), **refusing) as live:
        register_model(live.client, MODEL, f"file://{tiny_llama_dir}")
        assert live.client.post("/concepts", json={"name": "kept", "models": [MODEL], "records": RECORDS}).status_code == 202
        wait_concepts_ready(live.client, ["kept"], MODEL)
        yield live


@contextmanager
def refusing(flag: Path, errno_name: str, larger_than: int | None = None) -> Iterator[None]:
    """The store refuses writes with ``errno_name`` (only of files over ``larger_than`` bytes: a
    disk with a little room left) until the block ends."""
    flag.write_text(errno_name if larger_than is None else f"{errno_name} {larger_than}")
    try:
        yield
    finally:
        flag.unlink()


def test_a_full_store_is_a_503_naming_it_and_changes_nothing(server: LiveServer, flag: Path) -> None:
    api = server.client
    with refusing(flag, "ENOSPC"):
        answer = api.post("/concepts", json={"name": "no-room", "models": [MODEL], "records": RECORDS})
        assert_problem(answer, 503)
        assert "No space left on device" in answer.json()["detail"], answer.text
        assert answer.headers["Retry-After"]
        assert api.get("/concepts/no-room").status_code == 404
        assert api.get("/healthz").status_code == 200  # the connection and the process are fine
    answer = api.post("/concepts", json={"name": "no-room", "models": [MODEL], "records": RECORDS})
    assert answer.status_code == 202, answer.text  # space freed: the same request goes through


def test_statistics_that_do_not_fit_fail_the_job_naming_the_full_disk(server: LiveServer, flag: Path) -> None:
    api = server.client
    with refusing(flag, "ENOSPC", larger_than=64 << 10):  # room for the request's documents, not the statistics
        records = [{"prompt": p, "completion": c} for p, c in make_facts(12, seed=6)]
        answer = api.post("/concepts", json={"name": "too-big", "models": [MODEL], "records": records})
        assert answer.status_code == 202, answer.text
        job = wait_for_job(api, answer.json()["jobs"][0]["job_id"])
        assert job["status"] == "failed"
        assert job["error"]["status"] != 500, job["error"]
        assert "No space left on device" in job["error"]["detail"], job["error"]
        assert api.get("/concepts/too-big").json()["models"][MODEL]["status"] == "failed"


def test_a_read_only_store_is_a_503_naming_it_and_changes_nothing(server: LiveServer, flag: Path) -> None:
    api = server.client
    with refusing(flag, "EROFS"):
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
    assert api.delete("/concepts/kept").status_code == 204


def test_a_refused_write_leaves_the_connection_usable(server: LiveServer, flag: Path) -> None:
    """An unhandled error makes uvicorn close a kept-alive connection under the client's next request."""
    with refusing(flag, "EROFS"), httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.post("/concepts", json={"name": "x", "models": [MODEL], "records": RECORDS}).status_code == 503
        assert client.get("/healthz").status_code == 200
