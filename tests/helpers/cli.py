"""The ``engram`` CLI as its tests run it: a real subprocess against a live server, and what its exit
must look like (0 with no traceback, or 1 naming what went wrong on stderr)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from engram_fixtures.live import REPO_ROOT


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_cli(
    url: str, *args: str | Path, api_key: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``engram ARGS`` as a subprocess with ENGRAM_URL (and ENGRAM_API_KEY) set; no other ENGRAM_* leaks in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_") and k != "COLUMNS"}
    env.update(ENGRAM_URL=url, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    if api_key is not None:
        env["ENGRAM_API_KEY"] = api_key
    command = [sys.executable, "-m", "engram_client.cli", *map(str, args)]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """Assert exit code 0 (showing both streams otherwise) and that nothing printed a traceback."""
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result


def failed(result: subprocess.CompletedProcess[str], *mentions: str) -> str:
    """Assert exit code 1, no traceback, and every ``mentions`` on stderr; return stderr."""
    assert result.returncode == 1, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    for mention in mentions:
        assert says(result.stderr, mention), result.stderr
    return result.stderr


def says(printed: str, mention: str) -> bool:
    """Whether ``printed`` (what rich wrote to a terminal 80 columns wide) holds ``mention``, however it
    was wrapped: rich breaks lines between words and, in a box, inside a word too long for a line (a
    temporary path); whitespace and the box's borders are left out on both sides."""
    return _unwrapped(mention) in _unwrapped(printed)


def _unwrapped(text: str) -> str:
    return "".join(text.replace("│", " ").split())
