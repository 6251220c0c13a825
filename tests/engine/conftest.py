"""Engine tests run single-threaded (applies to every module in this folder)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny matrices gain nothing from threads, and on a busy 2-core box OpenMP's spinning
    threads made these tests ~7x slower; restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
