"""Embedded mode: a job that needs more memory than ENGRAM_JOB_MEMORY_BYTES fails by name, and the
job process runs the next job (issue 35, a memory budget per job enforced by the operating system).

The job that needs too much is a real one: a collection on a Llama whose MLP is 8,192 wide, whose
``down_proj`` input covariance alone is 8192² float64 = 537 MB, under a budget of 768 MiB for the
whole job process (which holds ~400 MB idle with every job body imported). Nothing is faked: the
job process's own ``RLIMIT_DATA`` makes the allocation fail. Without the budget the job succeeds
(and holds ~1 GB at its peak), so on code without it this test fails at its first assertion.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engram_fixtures.demo import tiny_llama_config
from engram_fixtures.live import wait_for_job
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.job_process import children, cmdline

BUDGET = 768 << 20
WIDE, SMALL = "budget/wide-mlp", "budget/tiny"
_EARLIER_CHILDREN: set[int] = set()  # this pytest process's children before the module's server started


def make_wide_mlp_llama(path: Path) -> Path:
    """A one-layer Llama, hidden 64, MLP 8,192 wide: 6 MB of weights, a 537 MB covariance."""
    tokenizer = make_tokenizer()
    config = tiny_llama_config(len(tokenizer), hidden=64, layers=1, heads=4, intermediate=8192, tokenizer=tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    root = tmp_path_factory.mktemp("job-memory")
    models = root / "models"
    make_wide_mlp_llama(models / "wide")
    make_tiny_llama(models / "tiny", hidden=32, layers=2)
    # Earlier modules in this pytest process may have left job processes of their own servers
    # (still shutting down): this server's is the one that was not there before it started.
    _EARLIER_CHILDREN.update(children(os.getpid()))
    with in_process_server(root / "server", models, ENGRAM_JOB_MEMORY_BYTES=str(BUDGET)) as server:
        register_model(server.client, WIDE, f"file://{models / 'wide'}")
        register_model(server.client, SMALL, f"file://{models / 'tiny'}")
        yield server


def job_process_pid() -> int:
    """This module's server's embedded job process (the in-process server's spawned child)."""
    found = [
        pid
        for pid in children(os.getpid())
        if pid not in _EARLIER_CHILDREN and "spawn_main" in cmdline(pid) and "resource_tracker" not in cmdline(pid)
    ]
    assert len(found) == 1, f"expected one job process of this module's server, found {found}"
    return found[0]


def collect(server: InProcessServer, name: str, model: str) -> dict[str, object]:
    records = [{"text": f"record {i} about {name}: the quick brown fox jumps over the lazy dog"} for i in range(8)]
    response = server.client.post("/concepts", json={"name": name, "models": [model], "records": records})
    assert response.status_code == 202, response.text
    [job] = response.json()["jobs"]
    return wait_for_job(server.client, job["job_id"], timeout=300)


def test_a_job_past_the_memory_budget_fails_by_name_and_the_job_process_runs_the_next(server: InProcessServer) -> None:
    process = job_process_pid()
    failed = collect(server, "too-wide", WIDE)
    assert failed["status"] == "failed", failed
    detail = failed["error"]["detail"]  # type: ignore[index]
    assert f"the job needed more than ENGRAM_JOB_MEMORY_BYTES={BUDGET} bytes" in detail, detail
    assert "raise it, or send a smaller input" in detail
    assert failed["error"]["status"] == 422  # type: ignore[index]

    after = collect(server, "small-enough", SMALL)
    assert after["status"] == "succeeded", after
    assert job_process_pid() == process, "the job process was replaced: the budget did not fail the job alone"
    assert server.client.get("/concepts/small-enough").json()["models"][SMALL]["status"] == "ready"


def test_the_job_process_states_its_budget_as_its_data_limit(server: InProcessServer) -> None:
    limits = Path(f"/proc/{job_process_pid()}/limits").read_text().splitlines()
    [data] = [line for line in limits if line.startswith("Max data size")]
    assert data.split()[3] == str(BUDGET), data  # the soft limit, in bytes
