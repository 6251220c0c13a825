"""Which workers are alive, per queue (``service.jobs.presence``), against a private ``redis-server``:
what ``/readyz`` reads in distributed mode. Entries are scored with Redis' clock, expire unless
renewed, and go at once when a worker stops cleanly."""

from __future__ import annotations

import time

import redis

from service.jobs.presence import PresenceBeacon, live_workers, presence_key


def test_a_beat_announces_a_worker_on_each_of_its_queues(client: redis.Redis) -> None:
    PresenceBeacon(client, "celery@a:1", ["gpu", "cpu"], ttl_s=30).beat()
    PresenceBeacon(client, "celery@b:2", ["cpu"], ttl_s=30).beat()
    assert live_workers(client, ["gpu", "cpu", "other"]) == {"gpu": 1, "cpu": 2, "other": 0}


def test_an_entry_nobody_renews_expires(client: redis.Redis) -> None:
    """A worker killed outright stops beating: after its TTL it no longer counts, and the next beat
    of anyone removes its entry."""
    PresenceBeacon(client, "celery@dead:1", ["gpu"], ttl_s=1).beat()
    assert live_workers(client, ["gpu"]) == {"gpu": 1}
    time.sleep(1.2)
    assert live_workers(client, ["gpu"]) == {"gpu": 0}
    PresenceBeacon(client, "celery@live:2", ["gpu"], ttl_s=30).beat()
    assert [m.decode() for m in client.zrange(presence_key("gpu"), 0, -1)] == ["celery@live:2"]


def test_a_running_beacon_keeps_its_worker_alive_and_a_clean_stop_removes_it_at_once(client: redis.Redis) -> None:
    beacon = PresenceBeacon(client, "celery@w:3", ["gpu", "cpu"], ttl_s=1)
    beacon.start()
    try:
        time.sleep(1.6)  # past one TTL: only renewals keep it
        assert live_workers(client, ["gpu", "cpu"]) == {"gpu": 1, "cpu": 1}
    finally:
        beacon.stop()
    assert live_workers(client, ["gpu", "cpu"]) == {"gpu": 0, "cpu": 0}


def test_a_presence_set_nobody_renews_goes_away(client: redis.Redis) -> None:
    PresenceBeacon(client, "celery@w:4", ["cpu"], ttl_s=5).beat()
    assert 0 < client.ttl(presence_key("cpu")) <= 10
