"""scripts/local-distributed.sh and Redis (issue 28): it never uses a Redis it did not start. Left
unset, REDIS_PORT is a free port where the script starts its own redis-server (not 6379, where a
Redis of other work may answer); a REDIS_PORT where a Redis already answers is refused, naming the
way out. Real processes: redis-server, the script; SeaweedFS's port is held busy so that ``start``
stops right after Redis (the whole recipe is tests/test_local_distributed.py)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from engram_fixtures.live import REPO_ROOT, RedisServer, start_redis, stop_redis

SCRIPT = REPO_ROOT / "scripts" / "local-distributed.sh"


@pytest.fixture
def busy_s3_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        yield taken.getsockname()[1]


def script_env(state: Path, s3_port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_", "AWS_", "REDIS_"))}
    return env | {"STATE": str(state), "S3_PORT": str(s3_port)} | extra


def run_script(env: dict[str, str], command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), command], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_a_private_redis_on_a_free_port(tmp_path: Path, busy_s3_port: int) -> None:
    env = script_env(tmp_path / "state", busy_s3_port)
    try:
        started = run_script(env, "start")
        assert started.returncode == 1 and f"port {busy_s3_port} is taken" in started.stderr, started.stderr
        settings = dict(line.split("=", 1) for line in (tmp_path / "state" / "settings.env").read_text().splitlines())
        port = int(settings["REDIS_PORT"])
        assert port != 6379
        pid = int((tmp_path / "state" / "redis.pid").read_text())
        assert redis.Redis(port=port, socket_timeout=2).info("server")["process_id"] == pid  # the one it started
    finally:
        stopped = run_script(env, "stop")
    assert stopped.returncode == 0 and "stopped redis" in stopped.stdout, stopped.stdout + stopped.stderr


def test_a_redis_it_did_not_start_is_refused(tmp_path: Path, busy_s3_port: int) -> None:
    theirs: RedisServer = start_redis()
    try:
        theirs_client = redis.Redis(port=theirs.port, socket_timeout=2)
        theirs_client.set("someone-elses", "data")
        env = script_env(tmp_path / "state", busy_s3_port, REDIS_PORT=str(theirs.port))
        started = run_script(env, "start")
        assert started.returncode == 1, started.stdout + started.stderr
        assert f"a Redis this script did not start answers on 127.0.0.1:{theirs.port}" in started.stderr
        assert "leave REDIS_PORT unset" in started.stderr
        assert not (tmp_path / "state" / "redis.pid").exists()
        run_script(env, "stop")
        assert theirs_client.get("someone-elses") == b"data"  # left running, untouched
    finally:
        stop_redis(theirs)
