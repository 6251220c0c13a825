"""Which workers are alive, per queue: what ``/readyz`` reads in distributed mode.

Each worker's main process keeps its name, for every queue it consumes, in the Redis sorted set
``engram:workers:<queue>``, scored with the time its entry expires (Redis' own clock plus
``ENGRAM_HEARTBEAT_TTL_S``, so the machines' clocks never matter). A thread renews it every quarter
of the TTL, as job heartbeats are renewed (:func:`service.execution.runner._heartbeat`). A worker killed
outright stops renewing and counts as gone once its entry expires; one that stops cleanly removes
itself at once. A queue with no live entry has no consumer: its jobs would wait forever, so the API
is not ready.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from service.config import Settings

log = logging.getLogger("engram.worker")


def presence_key(queue: str) -> str:
    return f"engram:workers:{queue}"


def redis_now(client: Any) -> float:
    """Seconds since the epoch on the Redis server's clock (the one every entry is scored with)."""
    seconds, microseconds = client.time()
    return float(seconds) + float(microseconds) / 1e6


class PresenceBeacon:
    """Keeps one worker's entries alive in the queues' presence sets until :meth:`stop`."""

    def __init__(self, client: Any, name: str, queues: Iterable[str], ttl_s: float) -> None:
        self.client, self.name, self.queues, self.ttl_s = client, name, sorted(queues), float(ttl_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """Renew this worker's entries and drop anyone's expired ones."""
        now = redis_now(self.client)
        pipe = self.client.pipeline(transaction=False)
        for queue in self.queues:
            key = presence_key(queue)
            pipe.zadd(key, {self.name: now + self.ttl_s})
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.expire(key, max(1, int(self.ttl_s * 2)))  # a set nobody renews goes away by itself
        pipe.execute()

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.beat()
                except Exception as exc:  # Redis away: the entries expire, and the API says why it is not ready
                    log.warning("worker presence heartbeat failed: %s", exc)
                self._stop.wait(max(0.5, self.ttl_s / 4))

        self._thread = threading.Thread(target=loop, name="worker-presence", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and remove this worker's entries (best effort: they expire anyway)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            pipe = self.client.pipeline(transaction=False)
            for queue in self.queues:
                pipe.zrem(presence_key(queue), self.name)
            pipe.execute()
        except Exception as exc:
            log.warning("could not remove the worker's presence entries: %s", exc)


def live_workers(client: Any, queues: Iterable[str]) -> dict[str, int]:
    """How many workers with an unexpired heartbeat consume each queue."""
    queues = list(queues)
    now = redis_now(client)
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.zcount(presence_key(queue), now, "+inf")
    return {queue: int(count) for queue, count in zip(queues, pipe.execute(), strict=True)}


def worker_presence(settings: Settings) -> tuple[Callable[..., None], Callable[..., None]]:
    """Celery receivers for ``worker_ready`` (start the beacon) and ``worker_shutdown`` (stop it).

    The queues are those the worker consumes (``engram-service worker --queues``); the entry's name
    is the node name and pid, unique even for several workers of one machine.
    """
    import redis

    beacons: list[PresenceBeacon] = []

    def on_ready(sender: Any = None, **_: object) -> None:
        try:
            queues = list(sender.app.amqp.queues.consume_from) if sender is not None else []
            hostname = getattr(sender, "hostname", None) or f"celery@{socket.gethostname()}"
            assert settings.broker_url is not None, "a Celery worker runs with a broker"
            client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=10)
            beacon = PresenceBeacon(client, f"{hostname}:{os.getpid()}", queues, settings.heartbeat_ttl_s)
            beacon.start()
            beacons.append(beacon)
            log.info("worker presence: announcing queues %s every %.1f s", ", ".join(queues), beacon.ttl_s / 4)
        except Exception:  # never keep a worker from working for its announcement
            log.exception("worker presence: could not start the heartbeat")

    def on_shutdown(**_: object) -> None:
        while beacons:
            beacons.pop().stop()

    return on_ready, on_shutdown
