"""A real ``mlflow server`` (sqlite backend, artifacts served by the server) for the tracking tests.

Started as an operator would run one for workers on other machines: ``--artifacts-destination``, so
a client uploads artifacts over HTTP (``mlflow-artifacts:/``) instead of writing into a folder of
the server's. One worker process (4 by default: 40 s to start on a 2-core machine, 10 s with one).
Its process group is ended with it: uvicorn's workers and the job consumer are its children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from engram_fixtures.live import free_port

STARTUP_TIMEOUT_S = 180.0  # a first start creates the sqlite schema (dozens of migrations)


@dataclass
class MlflowServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL when it lingers; the URL then refuses connections."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)


@contextmanager
def mlflow_server(root: Path) -> Iterator[MlflowServer]:
    """An ``mlflow server`` with its sqlite store and artifacts under ``root``, stopped after the block."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "mlflow-server.log"
    command = [
        *(sys.executable, "-m", "mlflow", "server"),
        *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
        *("--artifacts-destination", str(root / "artifacts")),
        *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    server = MlflowServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_healthy(server)
        yield server
    finally:
        server.stop()


def _wait_healthy(server: MlflowServer) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"mlflow server did not answer /health within {STARTUP_TIMEOUT_S:.0f}s:\n{server.log_tail()}")
