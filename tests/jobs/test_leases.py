"""Leases (``service.jobs.leases``) beyond what a universe build's parts test
(``tests/universes/test_universe_parts.py``: exclusive, named, released, renewed, expired): a holder
that lost its lease never extends or deletes the next holder's, the expiry has a floor, and embedded
mode grants every claim. Against a private ``redis-server``."""

from __future__ import annotations

import time
import uuid

import redis

from service.jobs.leases import LocalLeases, RedisLeases


def test_a_holder_that_lost_its_lease_neither_renews_nor_releases_the_next_holders(client: redis.Redis) -> None:
    leases = RedisLeases(client, f"test:{uuid.uuid4().hex}", ttl_s=1)
    key = leases.key("group:x")
    with leases.claim("group:x") as held:
        assert held
        # It stalled past its expiry and another worker claimed the part, for longer than this TTL.
        client.set(key, "other:2:next", px=5000)
        time.sleep(0.8)  # three of the stalled holder's renewal ticks
        assert client.pttl(key) > 3000, "renewing someone else's lease would cut it to this holder's 1 s"
    assert leases.holder("group:x") == "other:2:next", "the late release left the next holder's lease"


def test_a_lease_lasts_at_least_a_second() -> None:
    connection = redis.Redis()  # never connected: registering scripts sends nothing
    assert RedisLeases(connection, "scope", ttl_s=0.01).ttl_ms == 1000
    assert RedisLeases(connection, "scope", ttl_s=2.5).ttl_ms == 2500
    assert RedisLeases(connection, "universe:u1", ttl_s=2).key("group:a") == "engram:lease:universe:u1:group:a"


def test_embedded_mode_grants_every_claim() -> None:
    leases = LocalLeases()
    with leases.claim("group:x") as first, leases.claim("group:x") as second:
        assert first is True and second is True
