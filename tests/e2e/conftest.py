"""The end-to-end scenarios' fixtures: the real server with the mini-TOFU demo as its model root, and
the mini-CIFAR the vision scenarios share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engram_fixtures.live import LiveServer, running_server
from engram_fixtures.mini_cifar import MiniCifar, build_mini_cifar


@pytest.fixture(scope="module")
def tofu_server(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server of this module's own (embedded mode, file storage) that may register the demo model."""
    with running_server(tmp_path_factory.mktemp("tofu-server"), mini_tofu_demo) as live:
        yield live


@pytest.fixture(scope="module")
def mini_cifar() -> MiniCifar:
    """The mini-CIFAR and its trained classifiers (built once per cache, then found by content)."""
    torch.set_num_threads(1)
    return build_mini_cifar()
