"""The README's first walk-through, a real pretrained model forgetting the capitals it knows, run as
written against a live server.

Every ```bash block of the README's "Five minutes" section runs in one bash process (``set -eo
pipefail``) from a folder laid out as a clone after ``make real-demo``: its ``demo/`` is what that
target writes (:func:`bench.real_demo.build_real_demo`: SmolLM2-135M-Instruct hard-linked from the
fixture cache, the capitals and chemical symbols the model answers), served as ``make run`` serves
it. The figures ``engram evaluate`` prints must be the README's table's within three probes of each
set (tests/helpers/readme_figures.py says why), and the base must answer every listed fact. A
misspelt concept in the unlearn must stop the script with the service's did-you-mean.

Cost (2026-11-29, 2 cores shared with another test process, one torch thread): 6 min 8 s for the
module, 22 s of it building the clone's ``demo/`` (the conversion was cached) and 5 min 35 s the
walk-through: drawing and collecting the model's 64 samples ~100 s, the universe of the three
concepts and the variant ~100 s, the two evaluations ~30 s; the misspelt run under a second (every
object exists by then). The README's own steps, not the probes, are what it costs: it runs them
as a reader does.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.real_demo import build_real_demo
from engram_fixtures.live import LiveServer
from tests.helpers.readme_figures import REAL_ROWS, assert_within_probes, real_model_figures
from tests.helpers.walkthrough import (
    README_FIRST_SECTION,
    REPO,
    clone_like,
    evaluation_rows,
    pointed_at,
    run_bash,
    section_bash_blocks,
    without_fixture_lines,
)

pytestmark = pytest.mark.slow

# What each evaluate of the walk-through scores, in order: (forget file, retain file) -> the table's column.
EVALUATIONS = (("capitals", "symbols", 0), ("capitals-held-out", "symbols-held-out", 1))
# The misspelt run repeats the walk-through on the same server: everything up to the unlearn is
# there already (the same uploads and samples answer what the service has), so it stops in seconds;
# the bound only catches a script that would go on waiting.
FAILURE_PATH_BOUND_S = 300.0


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone after ``make real-demo`` (tests/docs/conftest.py's server serves its ``demo/``)."""
    work = clone_like(tmp_path_factory.mktemp("readme-real"), None)
    build_real_demo(work / "demo")
    return work


def walkthrough(base_url: str) -> str:
    readme = (REPO / "README.md").read_text()
    blocks = section_bash_blocks(readme, README_FIRST_SECTION)
    return pointed_at(without_fixture_lines("\n".join(block.rstrip("\n") for block in blocks)), base_url)


def evaluations(stdout: str) -> list[dict[str, dict[str, float]]]:
    """Each ``engram evaluate`` table of the output, in order (the CLI prints one per call)."""
    tables: list[str] = []
    current: list[str] = []
    for line in stdout.splitlines():
        if line.lstrip().startswith("split") and current:
            tables.append("\n".join(current))
            current = []
        current.append(line)
    tables.append("\n".join(current))
    return [rows for rows in (evaluation_rows(table) for table in tables) if rows]


def test_the_real_walkthrough_runs_as_written_and_gives_the_readmes_figures(server: LiveServer, clone: Path) -> None:
    done = run_bash(walkthrough(server.base_url), clone, timeout=1800)
    assert done.returncode == 0, done.report(server.log_tail())
    assert "alpha not given: used 0.25" in done.stdout, "the unlearn's warnings no longer name the default α"
    measured = evaluations(done.stdout)
    assert len(measured) == len(EVALUATIONS), done.stdout
    figures = real_model_figures()
    for rows, (forget_file, retain_file, column) in zip(measured, EVALUATIONS, strict=True):
        for split, name, row in (("forget", forget_file, REAL_ROWS[0]), ("retain", retain_file, REAL_ROWS[1])):
            probes = len((clone / "demo" / f"{name}.jsonl").read_text().splitlines())
            assert rows[split]["probes"] == probes, (name, rows)
            assert rows[split]["base exact"] == 100.0, f"the base no longer answers every fact of {name}: {rows}"
            assert_within_probes(rows[split]["variant exact"], figures[row][column], probes, f"{name} ({row})")


def test_a_misspelt_concept_stops_the_real_walkthrough_with_the_services_did_you_mean(
    server: LiveServer, clone: Path
) -> None:
    script = walkthrough(server.base_url)
    assert script.count('["capitals"]') == 1, "the walk-through no longer unlearns capitals once"
    started = time.monotonic()
    done = run_bash(script.replace('["capitals"]', '["capitols"]'), clone, timeout=FAILURE_PATH_BOUND_S + 60)
    took = time.monotonic() - started
    assert done.returncode != 0, done.report(server.log_tail())
    assert "capitols" in done.stderr and "did you mean" in done.stderr and "capitals" in done.stderr, done.report()
    assert "Traceback" not in done.stderr, done.report()
    assert evaluations(done.stdout) == [], "the walk-through went on past the failed unlearn"
    assert took < FAILURE_PATH_BOUND_S, took


def test_the_real_figures_are_read_and_a_figure_four_probes_off_fails() -> None:
    figures = real_model_figures()
    assert set(figures) == set(REAL_ROWS)
    stated = figures[REAL_ROWS[0]][0]
    assert_within_probes(stated + 3 * 100.0 / 26, stated, 26, "three probes off")
    with pytest.raises(AssertionError, match="the README says"):
        assert_within_probes(stated + 4 * 100.0 / 26, stated, 26, "four probes off")
    with pytest.raises(AssertionError, match="lost a row"):
        real_model_figures("## Five minutes\n| capitals (to forget) | 19% | 0% |\n")
