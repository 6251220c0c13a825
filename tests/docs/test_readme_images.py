"""The README's image example, run as written against a live server.

Its one ```bash block (section "An image classifier") trains the tiny ResNet with
``engram_fixtures.image_demo`` into the clone's ``demo/digits``, registers it, posts one concept per
class, unlearns class 0 and scores the variant with ``engram evaluate``. The README promises class
0's test accuracy falls to about 0% while the other classes keep most of theirs: checked here on the
CLI's own table, so a stale command or a changed answer shape fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer
from tests.helpers.walkthrough import (
    REPO,
    clone_like,
    pointed_at,
    run_bash,
    section_bash_blocks,
    without_fixture_lines,
)

SECTION = "## An image classifier"
pytestmark = pytest.mark.slow


def image_block(readme: str) -> str:
    [block] = section_bash_blocks(readme, SECTION)
    return block


def accuracy_rows(stdout: str) -> dict[tuple[str, str], float]:
    """``(model, set) -> accuracy %`` from the CLI's classifier table (``base │ forget │ 36 │ 94.4% │ …``)."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in re.split(r"[│┃|]", line)]
        if len(cells) >= 4 and cells[0] in ("base", "variant") and cells[1] in ("forget", "retain"):
            rows[(cells[0], cells[1])] = float(cells[3].rstrip("%"))
    return rows


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/docs/conftest.py's clone with an empty ``demo/``: the page's commands train the model there."""
    return clone_like(tmp_path_factory.mktemp("readme-images"), None)


def test_the_image_example_runs_as_written_and_forgets_the_class(server: LiveServer, clone: Path) -> None:
    readme = (REPO / "README.md").read_text()
    # "Same server, same BASE, api and wait_for": the five-minute section's first block defines them.
    helpers = pointed_at(without_fixture_lines(section_bash_blocks(readme, "## Five minutes")[0]), server.base_url)
    script = helpers + "\n" + image_block(readme)
    done = run_bash(script, clone, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.report(server.log_tail())
    rows = accuracy_rows(done.stdout)
    assert set(rows) == {(m, s) for m in ("base", "variant") for s in ("forget", "retain")}, done.stdout
    # The README's figures: class 0 from 94% to 0%, the other classes from 93.5% to 89%.
    assert rows[("base", "forget")] >= 85.0 and rows[("base", "retain")] >= 85.0, rows
    assert rows[("variant", "forget")] <= 10.0, rows
    assert rows[("variant", "retain")] >= rows[("base", "retain")] - 10.0, rows


def test_the_table_parser_reads_the_clis_rows() -> None:
    table = "base    │ forget │     36 │    94.4% │    0.1682 │       94.4%\nvariant │ retain │ 323 │ 89.2% │ 0.39 │ -"
    assert accuracy_rows(table) == {("base", "forget"): 94.4, ("variant", "retain"): 89.2}
