"""Real service processes for tests: uvicorn via `engram-service serve`, on a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
FINAL_JOB_STATES = {"succeeded", "failed", "cancelled"}


@dataclass
class LiveServer:
    base_url: str
    client: httpx.Client
    process: subprocess.Popen[bytes]
    storage: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def start_server(storage: Path, model_roots: Path, **env: str) -> Iterator[LiveServer]:
    """Run the API as a subprocess with embedded execution; stop it (SIGTERM, then kill) after."""
    port = free_port()
    environment = {
        **os.environ,
        "ENGRAM_STORAGE_URL": f"file://{storage}",
        "ENGRAM_MODEL_ROOTS": str(model_roots),
        **{f"ENGRAM_{k.upper()}": v for k, v in env.items()},
    }
    command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(command, cwd=REPO, env=environment)
    base_url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=base_url, timeout=60.0)
    try:
        _wait_healthy(client, process)
        yield LiveServer(base_url, client, process, storage)
    finally:
        client.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(client: httpx.Client, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not become healthy")


def wait_for_job(client: httpx.Client, job_id: str, timeout: float = 300.0) -> dict[str, Any]:
    """Poll a job until it ends; returns its final record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if job["status"] in FINAL_JOB_STATES:
            return job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} did not finish in {timeout}s")
