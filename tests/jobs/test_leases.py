"""Leases (``service.jobs.leases``) against a private ``redis-server``: a lease is exclusive, names its
holder, is renewed while held and expires when its holder stops; a holder that lost its lease never
extends or deletes the next holder's; the expiry has a floor; embedded mode grants every claim.

(A universe build's parts claimed by lease: ``tests/universes/test_universe_parts.py``.)"""

from __future__ import annotations

import time
import uuid

import redis

from service.jobs.leases import LocalLeases, RedisLeases, worker_name


def test_a_lease_is_exclusive_names_its_holder_and_is_released(client: redis.Redis) -> None:
    leases = RedisLeases(client, f"test:{uuid.uuid4().hex}", ttl_s=5)
    with leases.claim("group:x") as held:
        assert held
        holder = leases.holder("group:x")
        assert holder is not None and holder.startswith(worker_name() + ":")
        with leases.claim("group:x") as again:
            assert not again, "held: a second claim is refused"
        with leases.claim("group:y") as other:
            assert other, "another part is free"
    assert leases.holder("group:x") is None
    with leases.claim("group:x") as held:
        assert held


def test_a_held_lease_is_renewed_past_its_expiry(client: redis.Redis) -> None:
    leases = RedisLeases(client, f"test:{uuid.uuid4().hex}", ttl_s=1)
    with leases.claim("group:x") as held:
        assert held
        time.sleep(2.5)  # 2.5 expiries
        assert leases.holder("group:x") is not None
        assert 0 < client.pttl(leases.key("group:x")) <= 1000


def test_a_dead_holders_lease_expires_and_its_release_cannot_touch_the_next(client: redis.Redis) -> None:
    leases = RedisLeases(client, f"test:{uuid.uuid4().hex}", ttl_s=1)
    client.set(leases.key("group:x"), "gone:1:dead", px=600)  # a holder that died: no one renews it
    with leases.claim("group:x") as held:
        assert not held
    time.sleep(0.8)
    with leases.claim("group:x") as held:
        assert held
        leases._release(keys=[leases.key("group:x")], args=["gone:1:dead"])  # the dead holder, late
        assert leases.holder("group:x") is not None, "only the holder's own token releases a lease"


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
