"""How many torch threads the memory-bound arithmetic of a variant runs on.

A variant's write step is ``W + Σ c_k E_k`` block by block, a finiteness check, and each file hashed
on a second thread as it is written: it moves bytes, it hardly computes. torch's OpenMP pool makes
every one of those ops a parallel region that ends in a barrier; on a machine whose cores are busy
(other jobs, other tenants, the hashing thread itself) a team member that is descheduled holds the
barrier for a scheduler time slice, hundreds of times per layer. Measured on the 2-core build
machine at load ~8 (``bench.e2e``'s ~100M Llama, 1 and 3 concepts): 7-24 s with torch's 2 threads
against 0.8-1.7 s with one. More threads than a few never pay for a memory-bound add, so the
arithmetic gets at most :data:`MAX_ARITHMETIC_THREADS`, and one core is left to the hashing thread.

Decompositions and forward passes are compute-bound and keep torch's own thread count.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["MAX_ARITHMETIC_THREADS", "arithmetic_threads", "torch_threads"]

MAX_ARITHMETIC_THREADS = 4


def _usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def arithmetic_threads(cores: int | None = None) -> int:
    """Threads for a variant's arithmetic: the usable cores less one for the hashing thread, at least
    one, at most :data:`MAX_ARITHMETIC_THREADS` and never more than torch is configured for."""
    available = (cores if cores is not None else _usable_cores()) - 1
    return max(1, min(available, MAX_ARITHMETIC_THREADS, torch.get_num_threads()))


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with torch on ``threads`` intra-op threads, and restore the count after.

    torch's count is process-wide: another job running concurrently in the same process (the
    embedded executor's other lanes) runs on the same count meanwhile. The write step lasts seconds,
    and a collection that shares the process is the slower for it, not wrong.
    """
    previous = torch.get_num_threads()
    if threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
