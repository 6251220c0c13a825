"""DELETE /jobs/{id} stops a collection within seconds in every phase (issue 23, finding 8), on a
live server in embedded mode.

- The first pass over a large dataset (tokenizing every record to count the statistics' tokens)
  checked no cancellation: a 40k-row dataset stayed "running 0/0" for two minutes after DELETE.
  It now checks every half second; the job stops by itself, without the job process being killed.
- A phase stuck where no check can run (native code: a tokenizer on a huge input, a model load, a
  blocking read) is stopped by the embedded executor, which kills the job process
  ENGRAM_CANCEL_GRACE_S after the DELETE and starts a new one; the next collection then runs. What
  cannot be produced here on purpose, a native call lasting minutes, is stood in for by a test-only
  ``sitecustomize`` (``tests/api/stalling_tokenizer``) that sleeps inside the record cut for one
  marked record; everything else is the real server.
- The same stuck job, never cancelled, fails at ENGRAM_TASK_HARD_LIMIT_S naming it: embedded mode
  bounds a job's time as a Celery worker's hard limit does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.live import REPO_ROOT, LiveServer, running_server, wait_concepts_ready, wait_for_job
from tests.helpers.job_process import job_process

INJECTOR = Path(__file__).parent / "stalling_tokenizer"
MODEL = "cancel/tiny"
GRACE_S = 5.0  # a cooperative cancel must come well before it; a stuck job is killed at it
HARD_LIMIT_S = 30  # ENGRAM_TASK_HARD_LIMIT_S: every other job here ends within seconds, even on a loaded machine
ROWS = 200_000
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama_dir: Path) -> Iterator[LiveServer]:
    env = {
        "ENGRAM_MAX_JSON_BYTES": str(64 << 20),
        "ENGRAM_CANCEL_GRACE_S": str(GRACE_S),
        "ENGRAM_TASK_HARD_LIMIT_S": str(HARD_LIMIT_S),
        "PYTHONPATH": f"{INJECTOR}:{REPO_ROOT}",
    }
    with running_server(tmp_path_factory.mktemp("cancel-phases"), model_root, **env) as live:
        response = live.client.post("/models", json={"model_id": MODEL, "source": f"file://{tiny_llama_dir}"})
        assert response.status_code in (200, 201), response.text
        yield live


def post(api: httpx.Client, name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    response = api.post("/concepts", json={"name": name, "models": [MODEL], "records": records}, timeout=120)
    assert response.status_code == 202, response.text
    [job] = response.json()["jobs"]
    return dict(job)


def wait_running(api: httpx.Client, job_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (job := api.get(f"/jobs/{job_id}").json())["status"] != "running":
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return dict(job)


def cancel(api: httpx.Client, job_id: str) -> tuple[dict[str, Any], float]:
    """DELETE the job; its final record and the seconds until it was final."""
    asked = time.monotonic()
    assert api.delete(f"/jobs/{job_id}").status_code == 200
    final = wait_for_job(api, job_id, timeout=60)
    return final, time.monotonic() - asked


def test_a_large_dataset_is_cancelled_within_seconds_during_its_first_pass(server: LiveServer) -> None:
    api = server.client
    pid = job_process(server)
    rows = [{"text": f"{WORDS[i % 12]} {WORDS[(i * 7) % 12]} row {i}"} for i in range(ROWS)]
    job = post(api, "large", rows)
    wait_running(api, job["job_id"])
    time.sleep(2.0)  # the model is loaded, the first pass (tokenizing 200k records) is under way
    assert api.get(f"/jobs/{job['job_id']}").json()["progress"]["total"] == 0  # still surveying
    final, latency = cancel(api, job["job_id"])
    print(f"\n{ROWS} rows: cancelled during the first pass {latency:.2f}s after DELETE")  # noqa: T201
    assert final["status"] == "cancelled", final
    assert final["progress"]["total"] == 0  # the first pass never finished
    assert latency < GRACE_S  # its own check, before the grace kill (typically 0.1-0.4 s)
    assert job_process(server) == pid  # it stopped by itself: the job process was not killed


def test_a_phase_stuck_in_native_code_is_stopped_by_replacing_the_job_process(server: LiveServer) -> None:
    api = server.client
    pid = job_process(server)
    job = post(api, "stuck", [{"text": "STALL-IN-NATIVE-CODE and then some words"}])
    wait_running(api, job["job_id"])
    time.sleep(1.0)
    final, latency = cancel(api, job["job_id"])
    print(f"\nstuck in native code: cancelled {latency:.2f}s after DELETE (grace {GRACE_S}s)")  # noqa: T201
    assert final["status"] == "cancelled", final
    assert GRACE_S <= latency < GRACE_S + 10.0  # killed at the grace, replaced in seconds
    replacement = job_process(server)
    assert replacement != pid
    post(api, "after-the-stall", [{"text": "the new job process takes the next collection"}])
    wait_concepts_ready(api, ["after-the-stall"], timeout=120)


def test_a_stuck_job_fails_at_the_hard_time_limit_naming_it(server: LiveServer) -> None:
    api = server.client
    job = post(api, "stuck-forever", [{"text": "STALL-IN-NATIVE-CODE and nobody cancels it"}])
    wait_running(api, job["job_id"])
    started = time.monotonic()
    final = wait_for_job(api, job["job_id"], timeout=HARD_LIMIT_S + 30)
    print(f"\nstuck, not cancelled: {final['status']} after {time.monotonic() - started:.1f}s")  # noqa: T201
    assert final["status"] == "failed", final
    assert "ENGRAM_TASK_HARD_LIMIT_S" in final["error"]["detail"], final["error"]
    post(api, "after-the-limit", [{"text": "and the next collection runs"}])
    wait_concepts_ready(api, ["after-the-limit"], timeout=120)
