"""The README's two shell helpers, ``api`` and ``wait_for``, on the answers a walk-through can meet.

The helpers are the README's own lines (the first ```bash block of "Five minutes"), run with ``set -eo
pipefail`` against a plain file server (``python -m http.server``, a real process) whose files are the
service's answers: a ready concept, a concept whose collection failed and its job, a concept that stays
collecting. The failed one must stop with the job's error, the stuck one after the deadline with its
last answer; neither may loop. The happy path and the service's own answers are run against the real
service by tests/docs/test_readme_walkthrough.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.walkthrough import REPO, pointed_at, run_bash, section_bash_blocks, without_fixture_lines

JOB_ERROR = "record 3 has no completion: add one"
ANSWERS = {
    "concepts/ready": {"name": "ready", "models": {"m": {"status": "ready", "job_id": "j-0"}}},
    "concepts/broken": {"name": "broken", "models": {"m": {"status": "failed", "job_id": "j-1"}}},
    "concepts/stuck": {"name": "stuck", "models": {"m": {"status": "collecting", "job_id": "j-2"}}},
    "jobs/j-1": {"job_id": "j-1", "kind": "collect", "status": "failed", "error": {"status": 422, "detail": JOB_ERROR}},
}


def helpers(base: str, deadline_s: int | None = None) -> str:
    """The README's first walk-through block less the fixture lines: ``BASE``, ``api`` and ``wait_for``."""
    block = section_bash_blocks((REPO / "README.md").read_text(), "## Five minutes")[0]
    script = pointed_at(without_fixture_lines(block), base)
    assert "wait_for()" in script and "api()" in script, "the README no longer defines api and wait_for first"
    if deadline_s is not None:
        assert script.count("SECONDS + 300") == 1, "wait_for's deadline is no longer 300 s"
        script = script.replace("SECONDS + 300", f"SECONDS + {deadline_s}")
    return script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A file server whose paths answer as the service would; its base URL."""
    root = tmp_path_factory.mktemp("answers")
    for path, answer in ANSWERS.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        # Compact, as the service's JSON responses are: the helpers match '"status":"failed"'.
        (root / path).write_text(json.dumps(answer, separators=(",", ":")))
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{base}/concepts/ready", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_wait_for_returns_once_the_answer_is_ready(answers: str, tmp_path: Path) -> None:
    done = run_bash(helpers(answers) + "\nwait_for $BASE/concepts/ready\necho waited", tmp_path, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "waited", done.report()


def test_a_failed_collection_stops_with_the_jobs_error(answers: str, tmp_path: Path) -> None:
    started = time.monotonic()
    done = run_bash(helpers(answers) + "\nwait_for $BASE/concepts/broken\necho went on", tmp_path, timeout=30)
    assert done.returncode != 0 and "went on" not in done.stdout, done.report()
    assert '"status":"failed"' in done.stderr and JOB_ERROR in done.stderr, done.report()
    assert time.monotonic() - started < 10  # at once, not after the deadline


def test_a_wait_that_never_ends_stops_at_the_deadline_with_the_last_answer(answers: str, tmp_path: Path) -> None:
    started = time.monotonic()
    done = run_bash(helpers(answers, deadline_s=3) + "\nwait_for $BASE/concepts/stuck\necho went on", tmp_path, timeout=30)
    took = time.monotonic() - started
    assert done.returncode != 0 and "went on" not in done.stdout, done.report()
    assert "not ready after" in done.stderr and '"status":"collecting"' in done.stderr, done.report()
    # bash's $SECONDS counts whole seconds, so a 3 s deadline may end 2 s after the loop starts.
    assert 1.5 <= took < 15, took


def test_an_error_answer_stops_api_and_shows_it(answers: str, tmp_path: Path) -> None:
    """http.server's 404 for a path it does not have: not a problem document, so not "not there yet" either."""
    done = run_bash(helpers(answers) + "\napi $BASE/concepts/nowhere\necho went on", tmp_path, timeout=30)
    assert done.returncode != 0 and "went on" not in done.stdout, done.report()
    assert "404" in done.stderr, done.report()
