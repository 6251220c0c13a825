"""The README's tiny-demo walk-through ("A known answer key"), run as written against a live server.

The README's ``BASE``, ``api`` and ``wait_for`` (the first walk-through's first block: the real
model's, tests/docs/test_readme_real_walkthrough.py) and every ```bash block of the "A known answer
key" section run in one bash process (``set -eo pipefail``) from a folder laid out as a fresh clone
after ``make demo`` (tests/helpers/walkthrough.py says how, and which lines the fixtures stand for).
A stale command, a changed answer shape that breaks the README's ``api``/``wait_for``/``jq`` glue,
or figures further from the README's table than the spread between CPUs (read from it:
tests/helpers/readme_figures.py) fail here. So does a walk-through that hides a mistake: the same
script with the concept misspelt, or with a dataset the service refuses, must stop soon and show
the service's answer.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer
from tests.helpers.readme_figures import ALPHA_1, BASE_ROW, TOLERANCE_POINTS, assert_near, readme_figures
from tests.helpers.walkthrough import (
    REPO,
    evaluation_rows,
    readme_helpers,
    run_bash,
    section_bash_blocks,
    without_fixture_lines,
)

SECTION = "## A known answer key"
pytestmark = pytest.mark.slow


def walkthrough_blocks(readme: str) -> list[str]:
    return section_bash_blocks(readme, SECTION)


def walkthrough(readme: str, base: str) -> str:
    """The README's helpers, then the section's blocks ("same server, same BASE, api and wait_for")."""
    section = without_fixture_lines("\n".join(block.rstrip("\n") for block in walkthrough_blocks(readme)))
    return readme_helpers(readme, base) + "\n" + section


def substituted(script: str, old: str, new: str) -> str:
    """``script`` with its one ``old`` replaced: the mistake a reader makes when editing the page's commands."""
    assert script.count(old) == 1, f"the walk-through no longer has one {old!r}"
    return script.replace(old, new)


# Registering, uploading and unlearning again answer what the service has: the failure paths run in
# seconds after the walk-through, and within this bound alone (a collection of 200 facts included).
FAILURE_PATH_BOUND_S = 240.0


def test_the_walkthrough_runs_as_written_and_gives_the_readmes_figures(server: LiveServer, clone: Path) -> None:
    readme = (REPO / "README.md").read_text()
    done = run_bash(walkthrough(readme, server.base_url), clone)
    assert done.returncode == 0, done.report(server.log_tail())
    rows = evaluation_rows(done.stdout)
    assert set(rows) == {"forget", "retain"}, done.stdout
    # The README's table, read from the README: its base row and its α=1 row (the walk-through's request).
    figures = readme_figures(readme)
    assert rows["forget"]["probes"] == 20 and rows["retain"]["probes"] == 180
    for column, row in (("base exact", BASE_ROW), ("variant exact", ALPHA_1)):
        for index, split in enumerate(("forget", "retain")):
            assert_near(rows[split][column], figures[row][index], f"{split} {column} ({row})")


def test_the_figures_table_is_read_and_a_wrong_figure_fails() -> None:
    figures = readme_figures()
    assert figures[BASE_ROW] == (100.0, 100.0)
    forget, retain = figures[ALPHA_1]
    assert_near(retain + TOLERANCE_POINTS - 0.01, retain, "within the tolerance")
    with pytest.raises(AssertionError, match="the README says"):
        assert_near(retain + TOLERANCE_POINTS + 1.0, retain, "past the CPUs' spread")
    with pytest.raises(AssertionError, match="lost a row"):
        readme_figures("## The figures to expect\n| base model | 100% | 100% |\n")


def test_the_block_extraction_keeps_the_sections_commands_and_drops_make_demo_and_run() -> None:
    readme = (
        "intro\n## Five minutes\n```bash\nmake real-demo\nmake run\nBASE=http://127.0.0.1:8000\napi() {}\n```\n"
        "## A known answer key\n```bash\nmake demo\ncurl a\n```\ntext\n## Next\n```bash\ncurl b\n```\n"
    )
    script = walkthrough(readme, "http://x:1")
    assert script == "BASE=http://x:1\napi() {}\ncurl a"


def test_a_misspelt_concept_stops_the_walkthrough_with_the_services_did_you_mean(server: LiveServer, clone: Path) -> None:
    readme = (REPO / "README.md").read_text()
    script = substituted(walkthrough(readme, server.base_url), '["forget"]', '["forgte"]')
    started = time.monotonic()
    done = run_bash(script, clone, timeout=FAILURE_PATH_BOUND_S)
    took = time.monotonic() - started
    assert done.returncode != 0, done.report(server.log_tail())
    # The service's own problem reaches the reader, not a Python KeyError or an endless loop.
    assert "forgte" in done.stderr and "did you mean" in done.stderr and "forget" in done.stderr, done.report()
    assert "Traceback" not in done.stderr and "KeyError" not in done.stderr, done.report()
    assert evaluation_rows(done.stdout) == {}, "the walk-through went on past the failed unlearn"
    assert took < FAILURE_PATH_BOUND_S, took


def test_a_dataset_the_service_refuses_stops_the_walkthrough_at_the_upload(server: LiveServer, clone: Path) -> None:
    """A record without its completion, on line 3 of the upload: the 4xx naming it ends the script."""
    facts = (clone / "demo" / "forget.jsonl").read_text().splitlines()
    (clone / "demo" / "broken.jsonl").write_text("\n".join([*facts[:2], '{"prompt": "Q: Who?"}', *facts[2:]]) + "\n")
    readme = (REPO / "README.md").read_text()
    script = walkthrough(readme, server.base_url)
    script = substituted(script, "-F name=forget", "-F name=broken")
    script = substituted(script, "dataset=@demo/forget.jsonl", "dataset=@demo/broken.jsonl")
    done = run_bash(script, clone, timeout=FAILURE_PATH_BOUND_S)
    assert done.returncode != 0, done.report(server.log_tail())
    assert "line 3" in done.stderr, done.report()
    assert "Traceback" not in done.stderr, done.report()
    assert evaluation_rows(done.stdout) == {}, "the walk-through went on past the refused upload"
