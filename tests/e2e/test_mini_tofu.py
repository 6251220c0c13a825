"""Mini-TOFU through the live API in embedded mode (see ``tests/e2e/tofu.py``).

Run `pytest tests/e2e -s` to see the figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.tofu import run_mini_tofu
from tests.live import LiveServer, start_server, stop_server


@pytest.fixture(scope="module")
def server(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    work = tmp_path_factory.mktemp("tofu-server")
    live = start_server(work / "store", mini_tofu_demo, work / "server.log")
    try:
        yield live
    finally:
        stop_server(live)


def test_mini_tofu_forgets_and_retains_like_the_oracle(mini_tofu_demo: Path, server: LiveServer, tmp_path: Path) -> None:
    source = f"file://{mini_tofu_demo / 'demo' / 'model'}"
    result = run_mini_tofu(server.client, mini_tofu_demo, source, tmp_path, model_id="demo/mini-tofu")
    assert result["variant"]["status"] == "ready"
