"""Distributed mode: each Celery pool process runs under ENGRAM_JOB_MEMORY_BYTES (issue 35).

A job that needs more fails by name and the same pool process runs the next job; a pool process
that dies under a job (what the kernel's OOM killer does, stood in for by a SIGKILL of that process)
fails its job naming the budget instead of handing the message back to run, and kill, again; the
worker itself never dies. Redis, the API and the worker are real processes; the job that needs too
much is a real collection (a Llama whose MLP is 8,192 wide: a 537 MB covariance, under a 768 MiB
budget for a pool process holding ~400 MB idle).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from transformers import LlamaForCausalLM

from engram_fixtures.demo import make_facts, tiny_llama_config
from engram_fixtures.live import wait_for_job
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from tests.distributed.cluster import Cluster
from tests.helpers.api import register_model
from tests.helpers.job_process import alive, children

BUDGET = 768 << 20
WIDE, SMALL = "budget/wide-mlp", "budget/tiny"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("dist-budget")
    tokenizer = make_tokenizer()
    config = tiny_llama_config(len(tokenizer), hidden=64, layers=1, heads=4, intermediate=8192, tokenizer=tokenizer)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "models" / "wide", safe_serialization=True)
    tokenizer.save_pretrained(root / "models" / "wide")
    make_tiny_llama(root / "models" / "tiny", hidden=32, layers=2)
    cluster = Cluster(root, ENGRAM_JOB_MEMORY_BYTES=str(BUDGET))
    try:
        cluster.start_worker()
        for model, folder in ((WIDE, "wide"), (SMALL, "tiny")):
            register_model(cluster.api.client, model, f"file://{root / 'models' / folder}")
        yield cluster
    finally:
        cluster.close()


def pool_process(cluster: Cluster, timeout: float = 60) -> int:
    """The worker's one pool process (concurrency 1)."""
    deadline = time.monotonic() + timeout
    while True:
        pool = [pid for pid in children(cluster.workers[0].pid) if alive(pid)]
        if len(pool) == 1:
            return pool[0]
        assert time.monotonic() < deadline, f"pool processes: {pool}"
        time.sleep(0.2)


def submit(api: httpx.Client, name: str, model: str, records: list[dict[str, str]]) -> str:
    response = api.post("/concepts", json={"name": name, "models": [model], "records": records})
    assert response.status_code == 202, response.text
    [job] = response.json()["jobs"]
    return str(job["job_id"])


def few(name: str) -> list[dict[str, str]]:
    return [{"text": f"record {i} about {name}: the quick brown fox jumps over the lazy dog"} for i in range(8)]


def test_a_job_past_the_budget_fails_by_name_and_the_pool_process_runs_the_next(cluster: Cluster) -> None:
    api = cluster.api.client
    process = pool_process(cluster)
    failed = wait_for_job(api, submit(api, "too-wide", WIDE, few("too-wide")), timeout=300)
    assert failed["status"] == "failed", failed
    detail = failed["error"]["detail"]
    assert f"the job needed more than ENGRAM_JOB_MEMORY_BYTES={BUDGET} bytes" in detail, detail
    after = wait_for_job(api, submit(api, "fits", SMALL, few("fits")), timeout=300)
    assert after["status"] == "succeeded", after
    assert pool_process(cluster) == process, "the pool process was replaced: the budget did not fail the job alone"
    limits = open(f"/proc/{process}/limits").read().splitlines()
    assert next(line for line in limits if line.startswith("Max data size")).split()[3] == str(BUDGET)


def test_a_pool_process_killed_under_a_job_fails_it_naming_the_budget_and_the_worker_goes_on(cluster: Cluster) -> None:
    api = cluster.api.client
    process = pool_process(cluster)
    records = [{"text": " ".join(p + c for p, c in make_facts(40, seed=200 + i))} for i in range(400)]
    job_id = submit(api, "killed", SMALL, records)
    deadline = time.monotonic() + 120
    while api.get(f"/jobs/{job_id}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the collection never started"
        time.sleep(0.05)
    os.kill(process, signal.SIGKILL)  # what the OOM killer does
    failed = wait_for_job(api, job_id, timeout=60)
    assert failed["status"] == "failed", failed
    detail: Any = failed["error"]["detail"]
    assert "the job process died while running this job" in detail and "SIGKILL" in detail, detail
    assert f"ENGRAM_JOB_MEMORY_BYTES={BUDGET} bytes" in detail, detail
    time.sleep(3)  # the redelivered message finds the job failed and leaves it so
    assert api.get(f"/jobs/{job_id}").json()["status"] == "failed"
    assert cluster.workers[0].poll() is None, "the worker died"
    after = wait_for_job(api, submit(api, "after-kill", SMALL, few("after-kill")), timeout=300)
    assert after["status"] == "succeeded", after
    assert pool_process(cluster) != process
