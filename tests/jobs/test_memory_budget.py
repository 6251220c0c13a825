"""ENGRAM_JOB_MEMORY_BYTES (``service.execution.memory_budget``): what the budget is, how a failed
allocation is recognised, and the runner failing a job by name under a real ``RLIMIT_DATA``.

The last test runs in a child process of its own (a limit set in this test process would bind every
later test): it sets the budget as a job process does, runs two jobs through the real runner, one
whose body allocates past the budget with torch and one that fits, and prints their records.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from engram_fixtures.live import REPO_ROOT
from service.config import Settings
from service.execution.memory_budget import (
    DEFAULT_MEMORY_FRACTION,
    _read_limit,
    exhausted_memory,
    job_memory_limit,
    machine_memory_bytes,
    out_of_memory_problem,
)

BUDGET = 768 << 20


def test_the_default_budget_is_a_share_of_the_machine_and_zero_is_no_limit() -> None:
    machine = machine_memory_bytes()
    assert machine is not None and machine > 1 << 30
    assert machine <= int(Path("/proc/meminfo").read_text().split()[1]) * 1024  # never above MemTotal
    assert job_memory_limit(Settings()) == int(machine * DEFAULT_MEMORY_FRACTION)
    assert job_memory_limit(Settings(job_memory_bytes=0)) == 0
    assert job_memory_limit(Settings(job_memory_bytes=BUDGET)) == BUDGET


@pytest.mark.parametrize(
    ("written", "limit"),
    [("4294967296\n", 4 << 30), ("max\n", None), ("9223372036854771712\n", None), ("", None)],
    ids=["a limit", "v2 no limit", "v1 no limit", "empty"],
)
def test_a_cgroup_limit_file_is_read_as_a_limit_only_when_it_is_one(tmp_path: Path, written: str, limit: int | None) -> None:
    (tmp_path / "memory.max").write_text(written)
    assert _read_limit(tmp_path / "memory.max") == limit
    assert _read_limit(tmp_path / "absent") is None


def test_a_budget_below_an_idle_job_process_is_refused_at_start_up() -> None:
    with pytest.raises(ValidationError, match="ENGRAM_JOB_MEMORY_BYTES=1000 is below 512 MiB"):
        Settings(job_memory_bytes=1000)


def test_failed_host_allocations_are_recognised_and_device_ones_are_not() -> None:
    torch_says = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1"
    assert exhausted_memory(MemoryError())
    assert exhausted_memory(RuntimeError(torch_says))
    wrapped = ValueError("loading the model failed")  # a library's error raised from the failed allocation
    wrapped.__cause__ = MemoryError()
    assert exhausted_memory(wrapped)
    assert not exhausted_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not exhausted_memory(ValueError("not a number"))
    problem = out_of_memory_problem(BUDGET)
    assert problem.status == 422 and f"ENGRAM_JOB_MEMORY_BYTES={BUDGET} bytes" in problem.detail


CHILD = textwrap.dedent(
    """
    import json, sys, threading
    from pathlib import Path
    import torch
    from pydantic import BaseModel, ConfigDict
    from service.config import Settings
    from service.context import Context
    from service.execution import kinds
    from service.execution.memory_budget import apply_job_memory_limit
    from service.execution.runner import run_job
    from service.jobs.store import JobStore, new_job
    from service.storage.local import LocalStorage
    from tests.helpers.jobs import payload_for

    class Result(BaseModel):
        model_config = ConfigDict(extra="allow")

    class Body:
        result = Result
        def __init__(self, size):
            self.size = size
        def body(self, ctx, job):
            block = torch.ones(self.size, dtype=torch.uint8)  # written: resident, not only reserved
            return {"bytes": block.numel() * int(block[-1])}

    root = Path(sys.argv[1])
    settings = Settings(storage_url=f"file://{root / 'store'}", cache_dir=root / "cache", job_memory_bytes=int(sys.argv[2]))
    print("limit", apply_job_memory_limit(settings), file=sys.stderr)
    storage = LocalStorage(root / "store")
    jobs = JobStore(storage)
    ctx = Context(settings=settings, storage=storage, jobs=jobs, dispatch=lambda job: None, lock=threading.RLock())
    outcomes = []
    for size in (int(sys.argv[2]), 64 << 20):  # the whole budget, then a job that fits
        kinds.KINDS["map"] = Body(size)
        job_id = ctx.jobs.create(new_job("map", payload_for("map"), unit="steps")).job_id
        run_job(ctx, job_id)
        outcomes.append(ctx.jobs.get(job_id).model_dump(mode="json"))
    print(json.dumps(outcomes))
    """
)


def test_a_job_past_a_real_data_limit_fails_by_name_and_the_next_runs(tmp_path: Path) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(BUDGET)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    too_big, fits = json.loads(ran.stdout.splitlines()[-1])
    assert too_big["status"] == "failed", too_big
    assert too_big["error"]["detail"].startswith(f"the job needed more than ENGRAM_JOB_MEMORY_BYTES={BUDGET} bytes")
    assert too_big["error"]["status"] == 422
    assert fits["status"] == "succeeded" and fits["result"]["bytes"] == 64 << 20, fits
