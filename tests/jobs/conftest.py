"""The job machinery's own world: a real Context over LocalStorage in a temporary folder, and a
private ``redis-server`` (``tests.helpers.redis``) for the Redis-backed pieces (live records,
leases, presence, the reconciler).

Nothing here runs a model: job bodies in these tests are small functions of the test's own, put in
the kinds table where a domain's body would be (the state machine does not care what a body does).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from service.config import Settings
from service.context import Context
from service.jobs.store import JobStore, RedisJobStore
from service.storage.local import LocalStorage


def make_context(root: Path, redis_client: redis.Redis | None = None, **settings: Any) -> Context:
    """A Context as a process builds one, over local storage under ``root``: embedded mode's
    in-memory job store, or with ``redis_client`` distributed mode's (live records in Redis)."""
    storage = LocalStorage(root / "store")
    config = Settings(storage_url=f"file://{root / 'store'}", cache_dir=root / "cache", **settings)
    jobs = JobStore(storage) if redis_client is None else RedisJobStore(storage, redis_client, config.heartbeat_ttl_s)
    return Context(settings=config, storage=storage, jobs=jobs, dispatch=lambda job: None, lock=threading.RLock())


@pytest.fixture
def context_with(tmp_path: Path) -> Callable[..., Context]:
    """``context_with([redis_client], **settings)``: a Context over this test's folder with these settings."""
    return functools.partial(make_context, tmp_path)


@pytest.fixture
def ctx(tmp_path: Path) -> Context:
    """Embedded mode's in-memory job store over local storage."""
    return make_context(tmp_path)


@pytest.fixture
def client(redis_client: redis.Redis) -> redis.Redis:
    """The module's private Redis (``tests.helpers.redis``), emptied for each test."""
    return redis_client


@pytest.fixture
def redis_ctx(tmp_path: Path, client: redis.Redis) -> Context:
    """Distributed mode's job store: live records in Redis, durable ones in local storage."""
    return make_context(tmp_path, client, heartbeat_ttl_s=2)
