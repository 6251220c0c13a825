"""The README's five-minute walk-through, run as written against a live server.

Every ```bash block of the README's "Five minutes" section runs in one bash process (``set -eo
pipefail``) from a folder laid out as a fresh clone after ``make demo`` (tests/helpers/walkthrough.py
says how, and which two lines the fixtures stand for). A stale command, a changed answer shape that
breaks the README's ``grep``/``python3`` glue, or figures that no longer match the README's table
fail here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server
from tests.helpers.walkthrough import (
    REPO,
    clone_like,
    evaluation_rows,
    model_root,
    pointed_at,
    run_bash,
    without_fixture_lines,
)

SECTION = "## Five minutes"
pytestmark = pytest.mark.slow


def walkthrough_blocks(readme: str) -> list[str]:
    """The ```bash blocks between the walk-through's heading and the next ``## `` heading."""
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start : end if end != -1 else len(readme)]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def runnable(blocks: list[str], base: str) -> str:
    return pointed_at(without_fixture_lines("\n".join(block.rstrip("\n") for block in blocks)), base)


@pytest.fixture(scope="module")
def clone(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return clone_like(tmp_path_factory.mktemp("readme-clone"), mini_tofu_demo)


@pytest.fixture(scope="module")
def server(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    work = tmp_path_factory.mktemp("readme-server")
    live = start_server(work / "store", model_root(clone), work / "server.log")
    try:
        yield live
    finally:
        stop_server(live)


def test_the_walkthrough_runs_as_written_and_gives_the_readmes_figures(server: LiveServer, clone: Path) -> None:
    readme = (REPO / "README.md").read_text()
    done = run_bash(runnable(walkthrough_blocks(readme), server.base_url), clone)
    assert done.returncode == 0, done.report(server.log_tail())
    rows = evaluation_rows(done.stdout)
    assert set(rows) == {"forget", "retain"}, done.stdout
    # The README's table: α=1 forgets every fact (0%) and keeps about 41% of the retained ones.
    assert rows["forget"]["probes"] == 20 and rows["retain"]["probes"] == 180
    assert rows["forget"]["base exact"] == 100.0 and rows["retain"]["base exact"] == 100.0
    assert rows["forget"]["variant exact"] <= 5.0, rows
    assert 20.0 <= rows["retain"]["variant exact"] <= 60.0, rows


def test_the_block_extraction_keeps_the_sections_commands_and_drops_make_demo_and_run() -> None:
    readme = (
        "intro\n## Five minutes\n```bash\nmake demo\nBASE=http://127.0.0.1:8000\ncurl a\n```\n"
        "text\n## Next\n```bash\ncurl b\n```\n"
    )
    script = runnable(walkthrough_blocks(readme), "http://x:1")
    assert script == "BASE=http://x:1\ncurl a"
