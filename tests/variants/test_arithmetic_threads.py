"""A variant's memory-bound arithmetic runs on few torch threads (service.engine.threads, issue 27).

On a busy 2-core machine torch's two OpenMP threads made the write step of ``bench.e2e``'s ~100M
Llama 10-20× slower than one thread (each op's barrier waits for a descheduled team member). The
variant job must therefore write checkpoints and deltas on :func:`arithmetic_threads` threads and
give torch its own count back afterwards, whatever happens in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from service.engine import threads
from service.variants import build
from service.variants.service import submit_variant
from tests.helpers.store_world import StoreWorld, text_records

pytestmark = pytest.mark.fast


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("cores", "expected"),
    [(1, 1), (2, 1), (3, 2), (5, 4), (64, 4)],
)
def test_the_arithmetic_leaves_a_core_to_hashing_and_uses_at_most_four(
    cores: int, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert threads.arithmetic_threads(cores) == expected


def test_never_more_threads_than_torch_is_configured_for(two_torch_threads: None) -> None:
    assert threads.arithmetic_threads(64) == 2


def test_torch_threads_restores_the_count_when_the_block_raises(two_torch_threads: None) -> None:
    inside: list[int] = []

    def fail_inside() -> None:
        with threads.torch_threads(1):
            inside.append(torch.get_num_threads())
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert inside == [1]
    assert torch.get_num_threads() == 2


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    root = tmp_path_factory.mktemp("threads")
    w = StoreWorld(root)
    w.tiny_llama("t/llama", {"forget": text_records(0, 30), "retain": text_records(30, 90)})
    return w


@pytest.mark.parametrize(("fmt", "writer"), [("checkpoint", "write_checkpoint"), ("delta", "write_delta")])
def test_a_variant_is_written_on_the_arithmetic_threads_and_torch_gets_its_count_back(
    world: StoreWorld, fmt: str, writer: str, two_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(threads, "_usable_cores", lambda: 2)  # a 2-core machine: one thread is left to hashing
    seen: list[int] = []
    original = getattr(build, writer)

    def spying(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(build, writer, spying)
    options = {"scaling": "uniform", "format": fmt, "reference": ["forget", "retain"]}
    view, job = submit_variant(world.ctx, "t/llama", {"forget": -0.5 if fmt == "delta" else -0.6}, None, options)
    assert job is not None, view
    [done] = world.run_pending()
    assert done.status == "succeeded", done.error
    assert seen == [1]
    assert torch.get_num_threads() == 2
