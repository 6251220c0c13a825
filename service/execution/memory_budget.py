"""The memory one job process may hold (``ENGRAM_JOB_MEMORY_BYTES``), enforced by the operating system.

Every limit a job checks (records, pixels, tokens, rows) bounds what an input declares; this bound
is the last line behind them, for what an input turns out to cost. A job process (embedded mode's
job process, each Celery pool process) sets its own ``RLIMIT_DATA`` before it runs a job; an
allocation past it fails (``MemoryError``, or torch's ``RuntimeError: ... can't allocate memory``),
the job fails naming this setting, and the process lives on to run the next job.

Why ``RLIMIT_DATA``: since Linux 4.7 it counts the heap and every private writable mapping, which
is where tensors, arrays and Python objects live (glibc serves large allocations with ``mmap``).
It does not count what torch, OpenMP and CUDA reserve without writing (address space mapped
``PROT_NONE``), nor read-only mappings of weight files, so it measures what a job holds.
``RLIMIT_AS`` counts that reserved address space too: measured here, a process that has imported
torch and transformers maps 0.6 GB more than it holds, and CUDA reserves tens of GB, so a limit on
it would refuse real jobs long before memory runs out. A cgroup ``memory.max`` is not used: it
needs a delegated cgroup of the process's own, and past it the kernel's OOM killer ends the
process (every job in it) instead of failing one allocation the job can report.

The limit covers the whole process: in embedded mode the job process runs one job per lane at a
time, so jobs running together share it, and a loaded model kept between jobs
(``ENGRAM_MODEL_CACHE_SIZE``) counts too. A process killed anyway (the kernel's OOM killer when the
machine itself runs out, a native library that aborts on a failed allocation) fails the jobs it
was running with :func:`died_problem`, which names this budget.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import resource
from pathlib import Path

from service.config import Settings
from service.errors import JobFailed, ProblemDetails

log = logging.getLogger("engram.memory")

# The default budget's share of the machine's memory (the container's limit where lower). The rest
# is for the API beside an embedded job process (its requests are bounded, a few hundred MB), the
# operating system and the page cache that model loads read through. A job of an 8B model in
# bfloat16 holds ~16 GB of weights and its statistics: 80% of a 32 GB machine fits it.
DEFAULT_MEMORY_FRACTION = 0.8

# What native allocators say when an allocation fails (torch's CPU allocator raises a RuntimeError,
# C++ code a std::bad_alloc) and glibc's strerror(ENOMEM).
_EXHAUSTED_MARKS = ("can't allocate memory", "cannot allocate memory", "std::bad_alloc", "not enough memory")
_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded number just under 2**63

# The limit this process set on itself (0: none), so that what a job says is what was enforced.
_applied_bytes = 0


def machine_memory_bytes() -> int | None:
    """The memory this process's machine or container has: ``MemTotal``, or the cgroup's limit
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) where lower; None when neither can be read."""
    sizes = [size for size in (_mem_total(), _cgroup_limit()) if size]
    return min(sizes) if sizes else None


def _mem_total() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup, v2 or v1 (None: no limit, or not readable)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2: one unified hierarchy
                root, name = Path("/sys/fs/cgroup"), "memory.max"
            elif "memory" in controllers.split(","):
                root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
            else:
                continue
            # Inside a container (a cgroup namespace) the process's own cgroup is mounted at the root.
            for candidate in (root / path.lstrip("/") / name, root / name):
                limit = _read_limit(candidate)
                if limit is not None:
                    return limit
    return None


def _read_limit(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text().strip()
        if text and text != "max" and int(text) < _NO_LIMIT:
            return int(text)
    return None


def job_memory_limit(settings: Settings) -> int:
    """The bytes a job process may hold: ENGRAM_JOB_MEMORY_BYTES, or unset,
    :data:`DEFAULT_MEMORY_FRACTION` of :func:`machine_memory_bytes`; 0 means no limit."""
    if settings.job_memory_bytes is not None:
        return settings.job_memory_bytes
    machine = machine_memory_bytes()
    return int(machine * DEFAULT_MEMORY_FRACTION) if machine else 0


def apply_job_memory_limit(settings: Settings) -> int:
    """Limit this process's data (``RLIMIT_DATA``) to :func:`job_memory_limit`; returns the limit
    set (0: none). Only the soft limit is set, below any hard limit the process was given."""
    global _applied_bytes
    limit = job_memory_limit(settings)
    if limit <= 0:
        log.info("job memory not limited (ENGRAM_JOB_MEMORY_BYTES=0, or the machine's memory is unknown)")
        return 0
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    except (ValueError, OSError) as exc:  # a platform without it: the budget is then not enforced, and says so
        log.warning("could not limit job memory to %d bytes (ENGRAM_JOB_MEMORY_BYTES): %s", limit, exc)
        return 0
    _applied_bytes = limit
    log.info("job memory limited to %d bytes (ENGRAM_JOB_MEMORY_BYTES, RLIMIT_DATA)", limit)
    return limit


def applied_limit() -> int:
    """The limit :func:`apply_job_memory_limit` set in this process (0: none)."""
    return _applied_bytes


def exhausted_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a failed host-memory allocation.

    CUDA's out-of-memory errors are not: they are the device's memory, not this budget's.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError):
            return True
        text = str(current).lower()
        if isinstance(current, RuntimeError) and "cuda" not in text and any(m in text for m in _EXHAUSTED_MARKS):
            return True
        current = current.__cause__ or current.__context__
    return False


def _budget_words(limit: int) -> str:
    if limit > 0:
        return f"ENGRAM_JOB_MEMORY_BYTES={limit} bytes"
    return "the memory the machine could give (no ENGRAM_JOB_MEMORY_BYTES limit was in force)"


def out_of_memory_problem(limit: int | None = None) -> ProblemDetails:
    """The failed job's problem when an allocation past the budget failed (a 422: the user can act)."""
    limit = applied_limit() if limit is None else limit
    return JobFailed(
        f"the job needed more than {_budget_words(limit)}; raise it, or send a smaller input "
        "(fewer or shorter records, smaller images, a smaller model)"
    ).to_problem()


def died_problem(settings: Settings, reason: str) -> ProblemDetails:
    """The problem of a job whose process died under it (``reason``: the exit code or signal)."""
    return (
        JobFailed(
            f"the job process died while running this job ({reason}), most likely out of memory: a job "
            f"process may hold {_budget_words(job_memory_limit(settings))}, and the machine may have run "
            "out first; raise the budget or the machine's memory, or send a smaller input"
        )
        .to_problem()
        .with_members(status=500)
    )


def release_freed_memory() -> None:
    """After a job that ran out of memory: collect its cycles and give glibc's free pages back to the
    system, so the next job starts from the process's usual size, not from the failed one's peak."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
