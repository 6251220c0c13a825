"""Mini-TOFU through the live API in embedded mode (see ``tests/e2e/tofu.py``).

Run `pytest tests/e2e -s` to see the figures.
"""

from __future__ import annotations

from pathlib import Path

from engram_fixtures.live import LiveServer
from tests.e2e.tofu import run_mini_tofu


def test_mini_tofu_forgets_and_retains_like_the_oracle(
    mini_tofu_demo: Path, tofu_server: LiveServer, tmp_path: Path
) -> None:
    source = f"file://{mini_tofu_demo / 'demo' / 'model'}"
    result = run_mini_tofu(tofu_server.client, mini_tofu_demo, source, tmp_path, model_id="demo/mini-tofu")
    assert result["variant"]["status"] == "ready"
