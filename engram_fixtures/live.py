"""Real service processes for tests and benchmarks, and the helpers that wait on them.

House rule: services in tests are real processes. :func:`start_server` runs
``python -m service.cli serve`` on a free port with file storage and a model root, waits for
``/healthz``; :func:`stop_server` stops it (SIGTERM, then kill).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
FINISHED_JOB = {"succeeded", "failed", "cancelled"}
MAX_JSON_BYTES = 1024 * 1024  # the server's JSON body limit in tests: a 2 MB body must be a 413
STARTUP_TIMEOUT_S = 90.0

# ---------------------------------------------------------------- the live server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveServer:
    """A running ``engram-service serve`` process and a client bound to it."""

    base_url: str
    client: httpx.Client
    process: subprocess.Popen[bytes]
    storage_dir: Path
    model_root: Path
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def server_env(storage_dir: Path, model_root: Path, **extra: str) -> dict[str, str]:
    """The environment of a test server: inherited, minus ENGRAM_* settings, plus ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    env.update(
        ENGRAM_STORAGE_URL=f"file://{storage_dir}",
        ENGRAM_MODEL_ROOTS=str(model_root),
        ENGRAM_DEVICE="cpu",
        ENGRAM_MAX_JSON_BYTES=str(MAX_JSON_BYTES),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def start_server(storage_dir: Path, model_root: Path, log_path: Path, **env: str) -> LiveServer:
    """Start the real server on a free port and wait until ``/healthz`` answers."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO_ROOT,
        env=server_env(storage_dir, model_root, **env),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    client = httpx.Client(base_url=base_url, timeout=60.0)
    server = LiveServer(base_url, client, process, storage_dir, model_root, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            client.close()
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if client.get("/healthz", timeout=2.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"the server did not answer /healthz within {STARTUP_TIMEOUT_S:.0f}s:\n{server.log_tail()}")
        time.sleep(0.1)


@contextmanager
def running_server(root: Path, model_root: Path, **env: str) -> Iterator[LiveServer]:
    """A server of its own (storage under ``root``) for a test module, stopped afterwards."""
    server = start_server(root / "store", model_root, root / "server.log", **env)
    try:
        yield server
    finally:
        stop_server(server)


def stop_server(server: LiveServer, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL when it does not stop within ``grace_s``."""
    server.client.close()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=grace_s)


# ---------------------------------------------------------------- waiting helpers


def _poll(client: httpx.Client, path: str, done: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
    """GET ``path`` every 0.1 s until ``done(body)``; returns that body."""
    deadline = time.monotonic() + timeout
    while True:
        response = client.get(path)
        assert response.status_code == 200, response.text
        body = response.json()
        if done(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not settle within {timeout}s: {body}")
        time.sleep(0.1)


def wait_for_job(client: httpx.Client, job_id: str, timeout: float = 120) -> dict[str, Any]:
    """Poll ``GET /jobs/{job_id}`` until the job is succeeded, failed or cancelled; return it."""
    return _poll(client, f"/jobs/{job_id}", lambda job: job["status"] in FINISHED_JOB, timeout)


def post_and_wait(
    client: httpx.Client, path: str, body: dict[str, Any], timeout: float, params: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """POST ``body`` to ``path`` and wait for the job the answer started, if any: a 202 that is a job
    itself (``POST /models`` past its wait) or an answer naming one in ``job`` (universes, variants).

    Returns:
        The answer's body, and the finished job (None when the answer started none: 200/201).

    Raises:
        RuntimeError: naming ``path``, when the answer is not 200/201/202 or the job did not succeed.
    """
    answer = client.post(path, json=body, params=params)
    if answer.status_code not in (200, 201, 202):
        raise RuntimeError(f"POST {path}: {answer.status_code} {answer.text}")
    accepted: dict[str, Any] = answer.json()
    job = accepted if answer.status_code == 202 and "job_id" in accepted else accepted.get("job")
    if not job:
        return accepted, None
    finished = wait_for_job(client, job["job_id"], timeout=timeout)
    if finished["status"] != "succeeded":
        raise RuntimeError(f"POST {path}: its job {finished['status']}: {finished}")
    return accepted, finished


def wait_concepts_ready(
    client: httpx.Client, names: Iterable[str], model_id: str | None = None, timeout: float = 120
) -> dict[str, dict[str, Any]]:
    """Poll until every named concept is ``ready`` on ``model_id`` (every listed model when None).

    Returns:
        name -> the concept as ``GET /concepts/{name}`` shows it.

    Raises:
        AssertionError: a collection failed, or the timeout passed.
    """
    pending = list(dict.fromkeys(names))
    ready: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while pending:
        for name in list(pending):
            response = client.get(f"/concepts/{name}")
            assert response.status_code == 200, response.text
            concept = response.json()
            states = concept["models"] if model_id is None else {model_id: concept["models"].get(model_id)}
            if any(s is None for s in states.values()):
                raise AssertionError(f"concept {name} is not submitted to model {model_id}: {concept}")
            failed = {m: s for m, s in states.items() if s["status"] == "failed"}
            if failed:
                jobs = {m: client.get(f"/jobs/{s['job_id']}").json() for m, s in failed.items()}
                raise AssertionError(f"collection of concept {name} failed: {jobs}")
            if states and all(s["status"] == "ready" for s in states.values()):
                ready[name] = concept
                pending.remove(name)
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"concepts {pending} were not ready within {timeout}s")
        if pending:
            time.sleep(0.1)
    return ready


def wait_variant_ready(client: httpx.Client, variant_id: str, timeout: float = 120) -> dict[str, Any]:
    """Poll ``GET /variants/{variant_id}`` until it is no longer building; assert it is ready."""
    variant = _poll(client, f"/variants/{variant_id}", lambda v: v["status"] != "building", timeout)
    if variant["status"] != "ready":
        job = client.get(f"/jobs/{variant['job_id']}").json() if variant.get("job_id") else None
        raise AssertionError(f"variant {variant_id} failed: {job}")
    return variant


def download_variant(client: httpx.Client, variant: dict[str, Any], target: Path) -> Path:
    """Every file of a ready variant into ``target`` (created), as a user would fetch them."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in variant["files"]:
        response = client.get(f"/variants/{variant['variant_id']}/files/{entry['path']}")
        assert response.status_code == 200, response.text
        (target / entry["path"]).write_bytes(response.content)
    return target


def wait_idle(server: LiveServer, timeout: float = 120) -> None:
    """Wait until every job the server ever persisted is finished (nothing writes in the background)."""
    for key in sorted((server.storage_dir / "jobs").glob("*.json")):
        wait_for_job(server.client, key.stem, timeout=timeout)


# ---------------------------------------------------------------- distributed mode: Redis and workers


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def start_redis(port: int | None = None) -> RedisServer:
    """A private redis-server (no persistence, like the deployment's default) on a free port."""
    port = port or free_port()
    process = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return RedisServer(port, process)
        time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


def stop_redis(server: RedisServer) -> None:
    server.process.terminate()
    server.process.wait(timeout=10)


def start_worker(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """``engram-service worker`` as a subprocess in its own process group (so a kill takes its pool)."""
    log = log_path.open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "worker"],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    return process


def kill_worker(process: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signal the worker's whole process group (the main process and its pool children)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return
    process.wait(timeout=30)
