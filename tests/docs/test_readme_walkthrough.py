"""The README's five-minute walk-through, run as written against a live server.

Every ```bash block of the README's "Five minutes" section runs in one bash process (``set -eo
pipefail``) from a folder laid out as a fresh clone after ``make demo`` (tests/helpers/walkthrough.py
says how, and which two lines the fixtures stand for). A stale command, a changed answer shape that
breaks the README's ``grep``/``python3`` glue, or figures that no longer match the README's table
fail here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer
from tests.helpers.walkthrough import (
    REPO,
    evaluation_rows,
    pointed_at,
    run_bash,
    section_bash_blocks,
    without_fixture_lines,
)

SECTION = "## Five minutes"
pytestmark = pytest.mark.slow


def walkthrough_blocks(readme: str) -> list[str]:
    return section_bash_blocks(readme, SECTION)


def runnable(blocks: list[str], base: str) -> str:
    return pointed_at(without_fixture_lines("\n".join(block.rstrip("\n") for block in blocks)), base)


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
