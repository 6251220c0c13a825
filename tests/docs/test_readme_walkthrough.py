"""The README's five-minute walk-through, run as written against a live server.

Every ```bash block of the README's "Five minutes" section runs in one bash process (``set -eo
pipefail``) from a folder laid out as a fresh clone after ``make demo``: ``demo/`` holds the
mini-TOFU demo (the session's ``mini_tofu_demo``, built as ``make demo`` builds it) and ``.venv``
is this checkout's. Two lines are not run, because the fixture does what they do: ``make demo``
(the demo is built once per session) and ``make run`` (a live server of this module's own, with
the demo folder as its model root, the setting ``make run`` gives it); ``BASE`` is set to that
server's URL after the README sets it. A stale command, a changed answer shape that breaks the
README's ``grep``/``python3`` glue, or figures that no longer match the README's table fail here.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Five minutes"
RUN_BY_THE_FIXTURE = ("make demo", "make run")
pytestmark = pytest.mark.slow


def walkthrough_blocks(readme: str) -> list[str]:
    """The ```bash blocks between the walk-through's heading and the next ``## `` heading."""
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start : end if end != -1 else len(readme)]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def runnable(blocks: list[str], base: str) -> str:
    kept = [line for block in blocks for line in block.splitlines() if not line.lstrip().startswith(RUN_BY_THE_FIXTURE)]
    script = "\n".join(kept)
    assert "BASE=http://127.0.0.1:8000" in script, "the walk-through no longer sets BASE"
    return script.replace("BASE=http://127.0.0.1:8000", f"BASE={base}")


@pytest.fixture(scope="module")
def clone_like(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder shaped like a clone after ``make demo``: ``demo/`` and ``.venv``."""
    work = tmp_path_factory.mktemp("readme-clone")
    (work / "demo").symlink_to(mini_tofu_demo / "demo", target_is_directory=True)
    (work / ".venv").symlink_to(REPO / ".venv", target_is_directory=True)
    return work


@pytest.fixture(scope="module")
def server(mini_tofu_demo: Path, clone_like: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    work = tmp_path_factory.mktemp("readme-server")
    # The README registers file://$PWD/demo/model; $PWD/demo is a link to the built demo, so the
    # model root is the folder the link resolves into, as `make run` sets it to ./demo.
    live = start_server(work / "store", mini_tofu_demo, work / "server.log")
    try:
        yield live
    finally:
        stop_server(live)


def test_the_walkthrough_runs_as_written_and_gives_the_readmes_figures(server: LiveServer, clone_like: Path) -> None:
    readme = (REPO / "README.md").read_text()
    script = "set -eo pipefail\n" + runnable(walkthrough_blocks(readme), server.base_url)
    env = {**os.environ, "PWD": str(clone_like)}
    done = subprocess.run(["bash", "-c", script], cwd=clone_like, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}\nserver:\n{server.log_tail()}"
    rows = evaluation_rows(done.stdout)
    assert set(rows) == {"forget", "retain"}, done.stdout
    # The README's table: α=1 forgets every fact (0%) and keeps about 41% of the retained ones.
    assert rows["forget"]["probes"] == 20 and rows["retain"]["probes"] == 180
    assert rows["forget"]["base exact"] == 100.0 and rows["retain"]["base exact"] == 100.0
    assert rows["forget"]["variant exact"] <= 5.0, rows
    assert 20.0 <= rows["retain"]["variant exact"] <= 60.0, rows


def evaluation_rows(output: str) -> dict[str, dict[str, float]]:
    """``engram evaluate``'s table: split, probes, base NLL, variant NLL, ratio, base exact %, variant exact %."""
    rows = {}
    for line in output.splitlines():
        cells = [c for c in re.split(r"[│|\s]+", line) if c]
        if len(cells) == 7 and cells[0] in ("forget", "retain") and cells[-1].endswith("%"):
            rows[cells[0]] = {
                "probes": float(cells[1]),
                "base exact": float(cells[5].rstrip("%")),
                "variant exact": float(cells[6].rstrip("%")),
            }
    return rows


def test_the_block_extraction_keeps_the_sections_commands_and_drops_make_demo_and_run() -> None:
    readme = (
        "intro\n## Five minutes\n```bash\nmake demo\nBASE=http://127.0.0.1:8000\ncurl a\n```\n"
        "text\n## Next\n```bash\ncurl b\n```\n"
    )
    script = runnable(walkthrough_blocks(readme), "http://x:1")
    assert script == "BASE=http://x:1\ncurl a"
