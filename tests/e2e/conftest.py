"""The end-to-end scenarios' server: the real process, with the mini-TOFU demo as its model root."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server


@pytest.fixture(scope="module")
def tofu_server(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server of this module's own (embedded mode, file storage) that may register the demo model."""
    work = tmp_path_factory.mktemp("tofu-server")
    live = start_server(work / "store", mini_tofu_demo, work / "server.log")
    try:
        yield live
    finally:
        stop_server(live)
