"""scripts/local-distributed.sh, the README's recipe for distributed mode without Docker: it starts
Redis, SeaweedFS with the bucket, a Celery worker and the API, returns once ``/readyz`` is ready,
serves a whole flow (model, concept, variant stored in the bucket), and ``stop`` ends every process
it started.

Real processes throughout, on free ports, with the script's state in a temporary folder.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import REPO_ROOT, wait_concepts_ready, wait_variant_ready
from engram_fixtures.models import make_tiny_llama
from tests.helpers.api import register_model

SCRIPT = REPO_ROOT / "scripts" / "local-distributed.sh"


def _free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _s3_port() -> int:
    """A port whose SeaweedFS companions (port+1..+3, port+10001..+10004) are free too."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        if all(_free(p) for p in [port, *range(port + 1, port + 4), *range(port + 10001, port + 10005)]):
            return port
    raise RuntimeError("no free block of ports for SeaweedFS")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("local-distributed")
    models = root / "models"
    make_tiny_llama(models / "tiny", hidden=32, layers=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_", "AWS_"))}
    env.update(
        STATE=str(root / "state"),
        PORT=str(_free_port()),
        REDIS_PORT=str(_free_port()),
        S3_PORT=str(_s3_port()),
        ENGRAM_MODEL_ROOTS=str(models),
    )
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, cwd=REPO_ROOT, timeout=120, check=False)


def _script(env: dict[str, str], command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), command], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def _pids(state: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in state.glob("*.pid")}


def test_the_recipe_serves_a_variant_from_s3_and_stops_everything(setup: dict[str, str]) -> None:
    started = _script(setup, "start")
    assert started.returncode == 0, started.stdout + started.stderr
    state = Path(setup["STATE"])
    pids = _pids(state)
    assert set(pids) == {"redis", "weed", "worker", "api"}, pids  # no Redis answered on REDIS_PORT: it started one

    base = f"http://127.0.0.1:{setup['PORT']}"
    with httpx.Client(base_url=base, timeout=60) as api:
        ready = api.get("/readyz").json()
        assert ready == {"status": "ready", "mode": "distributed", "workers": {"cpu": 1, "gpu": 1}}, ready
        source = f"file://{setup['ENGRAM_MODEL_ROOTS']}/tiny"
        register_model(api, "local/tiny", source)
        facts = make_facts(8, seed=3)
        for name, part in (("forget", facts[:4]), ("retain", facts[4:])):
            body = {"name": name, "models": ["local/tiny"], "records": [{"prompt": p, "completion": c} for p, c in part]}
            assert api.post("/concepts", json=body).status_code == 202
        wait_concepts_ready(api, ["forget", "retain"], "local/tiny", timeout=300)
        submitted = api.post("/models/local/tiny/unlearn", json={"concepts": ["forget"], "alpha": 1.0})
        assert submitted.status_code == 202, submitted.text
        variant = wait_variant_ready(api, submitted.json()["variant"]["variant_id"], timeout=300)
        weights = api.get(f"/variants/{variant['variant_id']}/files/model.safetensors")
        assert weights.status_code == 200 and len(weights.content) > 0

    # Everything lives in the bucket the script created, under the printed storage URL. 'env' needs no
    # settings: it reports those 'start' chose.
    exports = _script({k: v for k, v in setup.items() if k not in {"PORT", "S3_PORT", "REDIS_PORT"}}, "env").stdout
    assert f"export ENGRAM_URL={base}\n" in exports, exports
    values = dict(part.split("=", 1) for line in exports.splitlines() for part in line.split()[1:] if "=" in part)
    assert values["ENGRAM_STORAGE_URL"] == "s3://engram/local"
    s3 = boto3.client(
        "s3",
        endpoint_url=values["ENGRAM_S3_ENDPOINT_URL"],
        aws_access_key_id=values["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=values["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="engram", Prefix="local/variants/").get("Contents", [])}
    assert f"local/variants/{variant['variant_id']}/manifest.json" in keys, sorted(keys)

    stopped = _script({k: v for k, v in setup.items() if k != "PORT"}, "stop")
    assert stopped.returncode == 0, stopped.stderr
    # Each stop is said as it starts and how it ended (issue 40: 29 silent seconds); only SeaweedFS, whose
    # graceful stop waits on timers of its own, is cut short, after the 2 s the script gives it.
    for name in pids:
        assert f"stopping {name} (pid" in stopped.stdout and f"stopped {name} (pid" in stopped.stdout, stopped.stdout
    assert [line for line in stopped.stdout.splitlines() if "SIGKILL after" in line and "stopped" in line] in (
        [],
        [f"local-distributed: stopped weed (pid {pids['weed']}) with SIGKILL after 2 s of SIGINT"],
    ), stopped.stdout
    for name, pid in pids.items():
        assert not _running(pid), f"{name} (pid {pid}) still runs after stop"
        assert not (state / f"{name}.pid").exists()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited process whose new parent has not reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in {"Z", "X"}
