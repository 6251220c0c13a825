"""Waiting and polling clients never starve health checks or jobs; the job process is supervised.

A server of this module's own (real process, embedded mode). To hold jobs queued for as long as a
test needs, the job process is paused with SIGSTOP and resumed with SIGCONT: the API process keeps
answering, which is the point. Latency bounds here are liveness checks (a starved route would take
the whole wait); throughput and p99 figures come from ``bench/polling.py``, not from tests.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import (
    LiveServer,
    running_server,
    start_server,
    stop_server,
    wait_concepts_ready,
    wait_for_job,
    wait_variant_ready,
)
from tests.helpers.api import assert_problem, register_model
from tests.helpers.job_process import alive, job_process, paused

MODEL = "poll/tiny"
MAX_WAITERS = 64
FACTS = make_facts(24, seed=11)
PROBES = [{"prompt": p, "completion": c} for p, c in FACTS[:2]]
# How long each waiting request waits: past the time every one of them takes to get in on a loaded
# machine (the job process is paused, so each wait runs out and answers 202).
WAIT_S = 12.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, model_root: Path) -> Iterator[LiveServer]:
    # These tests queue over a hundred evaluations from one caller on purpose: admission control's
    # bounds (service.jobs.admission) are raised past them.
    bounds = {"ENGRAM_MAX_QUEUED_JOBS": "1000", "ENGRAM_MAX_QUEUED_JOBS_PER_KEY": "1000"}
    with running_server(
        tmp_path_factory.mktemp("polling"), model_root, ENGRAM_MAX_WAITERS=str(MAX_WAITERS), **bounds
    ) as live:
        yield live


@pytest.fixture(scope="module")
def variant(server: LiveServer, tiny_llama_dir: Path) -> dict[str, Any]:
    api = server.client
    register_model(api, MODEL, f"file://{tiny_llama_dir}")
    records = [{"prompt": p, "completion": c} for p, c in FACTS]
    assert api.post("/concepts", json={"name": "polled", "models": [MODEL], "records": records}).status_code == 202
    wait_concepts_ready(api, ["polled"], MODEL)
    answer = api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["polled"], "alpha": 0.5})
    return wait_variant_ready(api, answer.json()["variant"]["variant_id"])


def _evaluate(server: LiveServer, variant_id: str, wait: float, index: int) -> httpx.Response:
    probes = [{"prompt": f"{p['prompt']} #{index}", "completion": p["completion"]} for p in PROBES]
    with httpx.Client(base_url=server.base_url, timeout=wait + 30) as client:
        return client.post(f"/variants/{variant_id}/evaluate", params={"wait": wait}, json={"forget": probes})


def _active_evaluations(server: LiveServer) -> set[str]:
    jobs = server.client.get("/jobs", params={"limit": 1000}).json()
    return {job["job_id"] for job in jobs if job["kind"] == "evaluate"}


def _wait_until_all_wait(server: LiveServer, before: set[str], count: int, timeout: float = 60.0) -> set[str]:
    """The evaluations the waiting requests submitted, once all ``count`` are in (a request is
    admitted as a waiter before its job is created, and the paused job process finishes none).

    A fixed sleep was not enough on a loaded machine: 64 requests were not all in after 2 s, the
    request meant to be the 65th waiter was admitted, and the test failed."""
    deadline = time.monotonic() + timeout
    while len(submitted := _active_evaluations(server) - before) < count:
        assert time.monotonic() < deadline, f"only {len(submitted)} of {count} waiting requests got in"
        time.sleep(0.1)
    return submitted


def _timed_get(client: httpx.Client, path: str) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = client.get(path)
    return time.perf_counter() - started, response


def _cancel_queued(server: LiveServer, answers: list[httpx.Response]) -> None:
    """Cancel the queued evaluations these answers started (while the job process is paused), so that
    no backlog of them runs into the next test: a later pause could stop the job process in the
    middle of one, and a later job would wait behind a hundred of them."""
    for answer in answers:
        cancelled = server.client.delete(f"/jobs/{answer.json()['job_id']}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text


def test_sixty_waiting_requests_leave_health_and_status_answering(server: LiveServer, variant: dict[str, Any]) -> None:
    with paused(job_process(server)):
        with concurrent.futures.ThreadPoolExecutor(60) as pool:
            before = _active_evaluations(server)
            waits = [pool.submit(_evaluate, server, variant["variant_id"], WAIT_S, i) for i in range(60)]
            queued = _wait_until_all_wait(server, before, 60)  # every request is in and waiting
            assert not any(w.done() for w in waits), "the waits ended early: nothing was tested"
            for path in ("/healthz", "/jobs", f"/variants/{variant['variant_id']}", "/concepts/polled", "/readyz"):
                seconds, response = _timed_get(server.client, path)
                assert response.status_code == 200, response.text
                assert seconds < 1.0, f"{path} took {seconds:.2f}s behind 60 waiting requests"
            assert _active_evaluations(server) - before == queued and len(queued) == 60
            answers = [w.result() for w in waits]
        assert {a.status_code for a in answers} == {202}  # the job process was paused for the whole wait
        _cancel_queued(server, answers[3:])
    for answer in answers[:3]:
        assert wait_for_job(server.client, answer.json()["job_id"])["status"] == "succeeded"


def test_waiters_beyond_the_cap_get_429_and_nothing_is_submitted(server: LiveServer, variant: dict[str, Any]) -> None:
    with paused(job_process(server)):
        with concurrent.futures.ThreadPoolExecutor(MAX_WAITERS) as pool:
            active = _active_evaluations(server)
            waits = [pool.submit(_evaluate, server, variant["variant_id"], WAIT_S, 1000 + i) for i in range(MAX_WAITERS)]
            _wait_until_all_wait(server, active, MAX_WAITERS)
            before = server.client.get("/jobs", params={"limit": 1000}).json()
            refused = _evaluate(server, variant["variant_id"], 6.0, 9999)
            problem = assert_problem(refused, 429, "ENGRAM_MAX_WAITERS")
            assert refused.headers["retry-after"].isdigit() and problem["status"] == 429
            assert server.client.get("/jobs", params={"limit": 1000}).json() == before  # the refused request made no job
            without_wait = _evaluate(server, variant["variant_id"], 0.0, 9998)  # not waiting: not capped
            assert without_wait.status_code == 202
            answers = [w.result() for w in waits]
        assert all(answer.status_code == 202 for answer in answers)
        _cancel_queued(server, [*answers, without_wait])


def test_fast_status_answers_equal_the_routes(server: LiveServer, variant: dict[str, Any]) -> None:
    api = server.client
    with paused(job_process(server)):
        job = _evaluate(server, variant["variant_id"], 0.0, 5000).json()
        polled = api.get(f"/jobs/{job['job_id']}").json()  # answered from memory
        # the route; earlier tests left over a hundred jobs queued: more than the default page
        listed = next(j for j in api.get("/jobs", params={"limit": 1000}).json() if j["job_id"] == job["job_id"])
        assert polled == listed and polled["status"] == "queued"
        api.get("/concepts")  # the route caches the concept document
        assert api.get("/concepts/polled").json() == next(c for c in api.get("/concepts").json() if c["name"] == "polled")
    assert wait_for_job(api, job["job_id"])["status"] == "succeeded"
    assert api.get(f"/jobs/{'0' * 32}").status_code == 404  # not live, not stored: the route's 404


def test_a_job_process_that_dies_fails_its_job_by_name_and_is_replaced(server: LiveServer, variant: dict[str, Any]) -> None:
    api = server.client
    first = job_process(server)
    records = [{"text": " ".join(p + c for p, c in make_facts(40, seed=100 + i))} for i in range(400)]
    job = api.post("/concepts", json={"name": "doomed", "models": [MODEL], "records": records}).json()["jobs"][0]
    deadline = time.monotonic() + 60
    while api.get(f"/jobs/{job['job_id']}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the collection never started"
        time.sleep(0.05)
    os.kill(first, signal.SIGKILL)
    failed = wait_for_job(api, job["job_id"], timeout=30)
    assert failed["status"] == "failed"
    assert "job process died" in failed["error"]["detail"] and "signal 9" in failed["error"]["detail"]
    assert job_process(server) != first
    again = _evaluate(server, variant["variant_id"], 30.0, 7000)  # the new job process runs jobs
    assert again.status_code == 200 and again.json()["status"] == "succeeded", again.text


def test_the_job_process_never_outlives_a_killed_api(tmp_path: Path, tiny_llama_dir: Path, model_root: Path) -> None:
    live = start_server(tmp_path / "store", model_root, tmp_path / "server.log")
    child = job_process(live)
    live.process.kill()  # kill -9: no shutdown hook runs
    live.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, f"job process {child} outlived its killed API"
        time.sleep(0.1)
    stop_server(live)
