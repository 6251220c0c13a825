"""The real application in the test's own process: the fast tier's server.

:func:`in_process_server` builds the app that ``engram-service serve`` runs
(:func:`service.api.app.create_app`) over a temporary file store and model root, with the settings a
live test server gets (:func:`engram_fixtures.live.server_env`), and drives it with FastAPI's
``TestClient`` (an ``httpx.Client`` over the ASGI app: no socket, no uvicorn, no interpreter to start).
Its lifespan runs as the real one does: the embedded executor (the job process, spawned once), the
callback dispatcher and the janitor start with it and stop after the block.

What it does not have: uvicorn's HTTP parsing (raw bytes, chunked bodies, keep-alive, headers that
are not UTF-8), a process to kill or to restart, and the server's log file. Tests of those keep the
live server (``engram_fixtures.live``); the checks of what the app answers do not need it.

:class:`InProcessServer` has the fields of :class:`engram_fixtures.live.LiveServer` that the request
helpers read (``client``, ``base_url``, ``storage_dir``, ``model_root``), so ``unchanged``,
``snapshot``, ``write_concept`` and the ``wait_*`` helpers take either.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engram_fixtures.live import LiveServer, server_env
from service.api.app import create_app
from service.config import Settings
from tests.helpers.proc import children

BASE_URL = "http://testserver"  # TestClient's host: what the app sees as its own URL


@dataclass
class InProcessServer:
    """The app, its settings and a client that calls it in this process."""

    base_url: str
    client: TestClient
    storage_dir: Path
    model_root: Path
    settings: Settings
    app: FastAPI
    # This process's children before the app started: the job process it spawns is the one child not
    # among them (an earlier module's server may still be stopping its own; tests.helpers.job_process).
    children_before: frozenset[int] = frozenset()


def in_process_settings(storage_dir: Path, model_root: Path, cache_dir: Path, **env: str) -> Settings:
    """The settings a live test server would read from its environment (``server_env``), read here.

    Only the ``ENGRAM_*`` variables are visible while they are read: the test process's own (a
    developer's shell) never leak in, as ``server_env`` keeps them from a live server.
    """
    variables = server_env(storage_dir, model_root, ENGRAM_CACHE_DIR=str(cache_dir), **env)
    engram = {k: v for k, v in variables.items() if k.startswith("ENGRAM_")}
    outside = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    with mock.patch.dict(os.environ, {**outside, **engram}, clear=True):
        return Settings()


@contextmanager
def in_process_server(root: Path, model_root: Path, **env: str) -> Iterator[InProcessServer]:
    """The real app over ``root/store`` (and ``root/cache``), started and stopped around the block.

    Args:
        root: a fresh directory of the test's own.
        model_root: ENGRAM_MODEL_ROOTS.
        **env: further ``ENGRAM_*`` settings, spelled as a live server's environment is.
    """
    storage_dir = root / "store"
    storage_dir.mkdir(parents=True, exist_ok=True)
    settings = in_process_settings(storage_dir, model_root, root / "cache", **env)
    app = create_app(settings)
    before = frozenset(children(os.getpid()))
    # A 500 is answered as uvicorn answers it, not raised into the test: the assertion names it.
    with TestClient(app, base_url=BASE_URL, raise_server_exceptions=False) as client:
        client.timeout = 60.0
        yield InProcessServer(BASE_URL, client, storage_dir, model_root, settings, app, before)


def another_client(server: InProcessServer | LiveServer, headers: dict[str, str]) -> httpx.Client:
    """A second client of the same server sending ``headers`` with every request (a key of its own).

    In process: a ``TestClient`` over the same app, outside its lifespan (the app is started once).
    """
    if isinstance(server, InProcessServer):
        return TestClient(server.app, base_url=server.base_url, headers=headers, raise_server_exceptions=False)
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=60.0)
