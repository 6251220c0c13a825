"""A private ``redis-server`` for the tests of the Redis-backed pieces (live records, leases,
presence, the reconciler, universe parts, Celery's queues): the real binary on a free port, one
per test module, with a connection emptied for each test. (The binary must be on PATH: ``make test``
checks it; ``engram_fixtures.live.start_redis`` starts it.)

Registered for every test module by ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from engram_fixtures.live import RedisServer, start_redis, stop_redis


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test module's own, stopped after the module."""
    server = start_redis()
    try:
        yield server
    finally:
        stop_redis(server)


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A connection to the module's Redis, emptied for each test."""
    connection = redis.Redis.from_url(redis_server.url)
    connection.flushdb()
    yield connection
    connection.close()
