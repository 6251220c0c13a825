"""The docs' walk-through, run as written against one live server: the tutorial, then the how-to
pages that continue it (outputs, evaluate and calibrate).

Their shell blocks run in order, in one bash process, from a folder laid out as a fresh clone after
``make demo`` (tests/helpers/walkthrough.py), with ``.venv/bin`` on ``PATH`` as the tutorial's
"activate the venv" says; then their Python blocks run in that folder, on the files the shell blocks
downloaded (in one interpreter, each block in a namespace of its own: torch is imported once). A
block no test can run carries ``<!-- not run: … -->``
and is counted by tests/docs/test_doc_inventory.py. The tutorial's output block is compared with
what its command printed, and the delta recipe's result with the checkpoint variant.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engram_fixtures.live import LiveServer
from tests.helpers.doc_examples import OUTPUT, PYTHON, SHELL, WALKTHROUGH_PAGES, Example, examples, shell_script
from tests.helpers.walkthrough import (
    Ran,
    evaluation_rows,
    pointed_at,
    run_bash,
    run_python_blocks,
    without_fixture_lines,
)

PAGES = WALKTHROUGH_PAGES
pytestmark = pytest.mark.slow


def blocks(kind: str) -> list[Example]:
    return [example for page in PAGES for example in examples(page) if example.kind == kind]


@pytest.fixture(scope="module")
def walked(server: LiveServer, clone: Path) -> Ran:
    """The pages' shell blocks, run once for the module (the Python blocks read what they wrote)."""
    script = pointed_at(without_fixture_lines(shell_script(blocks(SHELL))), server.base_url)
    done = run_bash(f'export PATH="$PWD/.venv/bin:$PATH"\n{script}', clone, timeout=600)
    assert done.returncode == 0, done.report(server.log_tail())
    return done


def test_the_shell_blocks_run_as_written_and_give_the_tutorials_figures(walked: Ran, server: LiveServer) -> None:
    rows = evaluation_rows(walked.stdout)
    assert set(rows) == {"forget", "retain"}, walked.stdout[-4000:]
    shown = evaluation_rows(tutorial_output().code)
    assert set(shown) == {"forget", "retain"}, "the tutorial's output block is no longer engram evaluate's table"
    for split in ("forget", "retain"):
        assert rows[split]["probes"] == shown[split]["probes"], (split, rows, shown)
        for column in ("base exact", "variant exact"):
            # A demo trained with other thread counts moves by a few points (the tutorial says so).
            assert abs(rows[split][column] - shown[split][column]) <= 10.0, (split, column, rows, shown)
    # GET /calibrations/{id} after the how-to's wait: the calibration it started succeeded.
    assert re.search(r'"calibration_id":"\w+"[^{}]*"status":"succeeded"', walked.stdout), "the calibration did not succeed"


def tutorial_output() -> Example:
    outputs = [e for e in examples(PAGES[0]) if e.kind == OUTPUT]
    assert len(outputs) == 1, "the tutorial shows one command output (engram evaluate's table)"
    return outputs[0]


def test_the_python_blocks_run_in_the_walkthroughs_folder(walked: Ran, server: LiveServer, clone: Path) -> None:
    """Each block in a namespace of its own, in page order, on the files the shell blocks wrote."""
    python = blocks(PYTHON)
    done = run_python_blocks(
        [(e.where, e.code) for e in python],
        clone,
        ENGRAM_URL=server.base_url,  # the client's default, as the tutorial exports it
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    assert done.returncode == 0, done.report(server.log_tail())
    assert done.stdout.count("--- ") == len(python), done.stdout
    # Every file the pages write goes into demo/, beside the demo: the checkout's root holds what a clone has.
    assert sorted(path.name for path in clone.iterdir()) == [".venv", "demo"]
    demo = clone / "demo"
    # The delta recipe says its folder holds the checkpoint variant's weights: it does.
    assert_same_weights(demo / "forgot-from-delta" / "model.safetensors", demo / "forgot" / "model.safetensors")


def assert_same_weights(applied: Path, checkpoint: Path) -> None:
    """The delta recipe's folder holds the checkpoint variant's weights (the page says so)."""
    got, want = load_file(applied), load_file(checkpoint)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    differing = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differing, differing


def test_the_pages_blocks_are_found() -> None:
    """The extraction: the tutorial's register and unlearn, the CLI, and the four output recipes."""
    script = shell_script(blocks(SHELL))
    assert re.search(r"api -X POST \"\$BASE/models", script) and "engram unlearn" in script
    assert len([e for e in blocks(PYTHON) if e.page.name == "outputs.md"]) == 4
