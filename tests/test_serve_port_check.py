"""``engram-service serve`` on a busy port (issue 28): it says so and how to pick another port, in
one plain line, before starting anything, instead of uvicorn's JSON log line. A real process, and
a real socket listening on the port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def test_a_busy_port_is_refused_with_how_to_pick_another(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        env = os.environ | {"ENGRAM_STORAGE_URL": f"file://{tmp_path / 'store'}", "ENGRAM_LOG_FORMAT": "json"}
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == f"port {port} is in use: pass PORT=<n> to make run (or --port)"
    assert not (tmp_path / "store").exists()  # refused before anything started


def test_a_free_port_is_not_taken_for_busy() -> None:
    from service.cli import _port_in_use

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    assert not _port_in_use("127.0.0.1", port)
