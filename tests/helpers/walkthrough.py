"""Running a page's walk-through as written: a folder shaped like a clone, a server, one bash process.

Shared by the README's walk-through (tests/docs/test_readme_walkthrough.py) and the docs' own
(tests/docs/test_docs_walkthrough.py). The folder looks like a fresh clone after ``make demo``:
``demo/`` is the session's mini-TOFU demo (``mini_tofu_demo``, built as ``make demo`` builds it) and
``.venv`` is this checkout's. ``make demo`` and ``make run`` are not run (the fixtures do what they
do: the demo is built once per session, and each module starts a live server whose model root is
the demo, the setting ``make run`` gives it); ``BASE`` is pointed at that server where the page sets it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_BY_THE_FIXTURE = ("make demo", "make real-demo", "make run")
# The README's first walk-through: its first block defines BASE, api and wait_for for every later one.
README_FIRST_SECTION = "## Five minutes"
DEFAULT_BASE = "BASE=http://127.0.0.1:8000"


def clone_like(work: Path, mini_tofu_demo: Path | None) -> Path:
    """``work`` laid out as a clone after ``make demo``: ``demo/`` and ``.venv``.

    ``demo/`` is a folder of hard links to the built demo's files (a copy where links cannot be
    made), not a symlink: the CLI resolves ``./demo/model`` to an absolute path, and through a link
    it would name another folder than the ``file://$PWD/demo/model`` the curl commands register.
    Serve it with :func:`model_root` as the server's model root, as ``make run`` serves ``./demo``.
    ``mini_tofu_demo`` None: ``demo/`` is empty, for a page whose commands build their own model there.
    """
    if mini_tofu_demo is None:
        (work / "demo").mkdir()
    else:
        shutil.copytree(mini_tofu_demo / "demo", work / "demo", copy_function=_link_or_copy)
    (work / ".venv").symlink_to(REPO / ".venv", target_is_directory=True)
    return work


def section_bash_blocks(page: str, heading: str) -> list[str]:
    """The ```bash blocks between ``heading`` (a ``## `` line of ``page``) and the next ``## `` heading."""
    start = page.index(heading)
    end = page.find("\n## ", start + len(heading))
    return re.findall(r"```bash\n(.*?)```", page[start : end if end != -1 else len(page)], flags=re.S)


def model_root(clone: Path) -> Path:
    """What ``make run`` sets ``ENGRAM_MODEL_ROOTS`` to: the clone's ``demo/``."""
    return clone / "demo"


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def pointed_at(script: str, base_url: str) -> str:
    """The script with the page's ``BASE=http://127.0.0.1:8000`` set to the test server's URL."""
    assert DEFAULT_BASE in script, "the walk-through no longer sets BASE"
    return script.replace(DEFAULT_BASE, f"BASE={base_url}")


def without_fixture_lines(script: str) -> str:
    return "\n".join(line for line in script.splitlines() if not line.lstrip().startswith(RUN_BY_THE_FIXTURE))


def readme_helpers(readme: str, base_url: str) -> str:
    """The README's ``BASE``, ``api`` and ``wait_for`` (its first walk-through's first block, less the
    lines the fixtures stand for), pointed at ``base_url``: what "same server, same BASE" sections run first."""
    return pointed_at(without_fixture_lines(section_bash_blocks(readme, README_FIRST_SECTION)[0]), base_url)


def _without_engram_settings() -> dict[str, str]:
    """This process's environment without the service's and the client's ``ENGRAM_*`` settings; the
    fixture cache (``ENGRAM_FIXTURE_CACHE``, engram_fixtures.cache) is kept: a page's command that
    builds a fixture finds what this run trained."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_") or k == "ENGRAM_FIXTURE_CACHE"}


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str

    def report(self, server_log: str = "") -> str:
        outputs = f"stdout:\n{self.stdout[-6000:]}\nstderr:\n{self.stderr[-6000:]}"
        return f"exit {self.returncode}\n{outputs}\nserver:\n{server_log}"


def run_bash(script: str, cwd: Path, timeout: float = 900, **env: str) -> Ran:
    """``set -eo pipefail`` and the script, in one bash process in ``cwd`` (as a reader's terminal)."""
    return _run(["bash", "-c", "set -eo pipefail\n" + script], cwd, timeout, None, PWD=str(cwd), **env)


def _run(command: list[str], cwd: Path, timeout: float, stdin: str | None, **env: str) -> Ran:
    """``command`` in ``cwd`` with this process's environment less the ``ENGRAM_*`` settings, plus ``env``."""
    # A reader's own ENGRAM_* settings (ENGRAM_URL, ENGRAM_API_KEY) must not steer the CLI's calls.
    environment = _without_engram_settings()
    environment.update(env)
    done = subprocess.run(command, input=stdin, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)
    return Ran(done.returncode, done.stdout, done.stderr)


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


# Runs each block in a namespace of its own, in one interpreter: importing torch and transformers
# once for all of them, not once per block (tens of seconds on a busy machine). Stops at the first
# block that raises and names it.
_BLOCK_RUNNER = """
import json, sys, traceback
for block in json.load(sys.stdin):
    print(f"--- {block['where']}", flush=True)
    try:
        exec(compile(block["code"], block["where"], "exec"), {"__name__": "__main__"})
    except BaseException:
        print(f"FAILED {block['where']}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def run_python_blocks(blocks: list[tuple[str, str]], cwd: Path, timeout: float = 600, **env: str) -> Ran:
    """``(where, code)`` blocks run in order by one fresh interpreter in ``cwd``; the first failure stops it."""
    payload = json.dumps([{"where": where, "code": code} for where, code in blocks])
    return _run([sys.executable, "-c", _BLOCK_RUNNER], cwd, timeout, payload, **env)
