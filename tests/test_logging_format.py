"""Log lines a person can read at a terminal (issue 28): ``configure_logging`` writes plain
``time level logger: message`` lines when stderr is a TTY or ENGRAM_LOG_FORMAT=text, and one JSON
object per line otherwise (a container's stderr), as before. Each case runs in a real child process
whose stderr is a pseudo-terminal or a pipe."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG_ONE_LINE = (
    "import logging; from service.observability import configure_logging; configure_logging(); "
    "logging.getLogger('engram.probe').warning('port %d is busy', 8000)"
)
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING engram\.probe: port 8000 is busy$")


def stderr_of_child(*, tty: bool, log_format: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ENGRAM_LOG_FORMAT"}
    if log_format is not None:
        env["ENGRAM_LOG_FORMAT"] = log_format
    if not tty:
        done = subprocess.run(
            [sys.executable, "-c", LOG_ONE_LINE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stderr
    leader, follower = pty.openpty()
    try:
        child = subprocess.Popen([sys.executable, "-c", LOG_ONE_LINE], cwd=ROOT, env=env, stderr=follower)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert child.wait(timeout=120) == 0
    finally:
        os.close(leader)
    return b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.parametrize(("tty", "log_format"), [(True, None), (True, "auto"), (False, "text")])
def test_text_lines_on_a_terminal_or_when_asked(tty: bool, log_format: str | None) -> None:
    lines = stderr_of_child(tty=tty, log_format=log_format).strip().splitlines()
    assert len(lines) == 1 and TEXT_LINE.match(lines[0]), lines


@pytest.mark.parametrize(("tty", "log_format"), [(False, None), (False, "auto"), (True, "json")])
def test_json_lines_otherwise(tty: bool, log_format: str | None) -> None:
    lines = stderr_of_child(tty=tty, log_format=log_format).strip().splitlines()
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["level"] == "WARNING" and record["logger"] == "engram.probe"
    assert record["message"] == "port 8000 is busy" and record["job_id"] is None


def test_an_unknown_log_format_is_refused() -> None:
    from pydantic import ValidationError

    from service.config import Settings

    with pytest.raises(ValidationError, match="log_format"):
        Settings(log_format="xml")  # type: ignore[arg-type]
