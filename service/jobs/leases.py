"""Leases: one worker at a time on one part of a job's work (an input group of a universe), with expiry.

A lease is a Redis key set only if absent (``SET NX``) with an expiry of ``ENGRAM_HEARTBEAT_TTL_S``,
holding its holder's token (``host:pid:<uuid>``, so an operator can read who holds it). While the
holder works, a thread renews the expiry every quarter of it, as job heartbeats are sent; a holder
that dies stops renewing, its lease expires, and the next worker to look claims the part. Renewal
and release compare the token first (one Lua script each), so a holder that stalled past its expiry
never extends or deletes a lease another worker holds by then.

Embedded mode has one process building: :class:`LocalLeases` grants every claim.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

log = logging.getLogger("engram.leases")

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def worker_name() -> str:
    """This process as job results and lease tokens name it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Leases(Protocol):
    """Claims on the parts of one piece of work."""

    def claim(self, part: str) -> Any:
        """A context manager giving True while this process holds ``part``, False when another does."""
        ...


class LocalLeases:
    """One builder per process and no other process: every claim is granted."""

    @contextmanager
    def claim(self, part: str) -> Iterator[bool]:
        yield True


class RedisLeases:
    """Leases on ``engram:lease:<scope>:<part>`` keys, shared by every worker of a deployment.

    Args:
        client: a ``redis.Redis``.
        scope: what the parts belong to (``universe:<id>``).
        ttl_s: the expiry: a holder silent this long loses the part.
    """

    def __init__(self, client: Any, scope: str, ttl_s: float) -> None:
        self.client, self.scope, self.ttl_ms = client, scope, max(1000, int(ttl_s * 1000))
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def key(self, part: str) -> str:
        return f"engram:lease:{self.scope}:{part}"

    def holder(self, part: str) -> str | None:
        """The token of whoever holds ``part`` now (``host:pid:<uuid>``), or None."""
        raw = self.client.get(self.key(part))
        return None if raw is None else raw.decode()

    @contextmanager
    def claim(self, part: str) -> Iterator[bool]:
        key, token = self.key(part), f"{worker_name()}:{uuid.uuid4().hex}"
        if not self.client.set(key, token, nx=True, px=self.ttl_ms):
            yield False
            return
        stop = threading.Event()
        renewing = threading.Thread(target=self._keep, args=(key, token, stop), name=f"lease-{part}", daemon=True)
        renewing.start()
        try:
            yield True
        finally:
            stop.set()
            renewing.join(timeout=5)
            try:
                self._release(keys=[key], args=[token])
            except Exception as exc:  # Redis briefly away: the lease expires on its own
                log.warning("could not release lease %s: %s", key, exc)

    def _keep(self, key: str, token: str, stop: threading.Event) -> None:
        """Renew the lease every quarter of its expiry until ``stop``; give up once it is lost."""
        while not stop.wait(max(0.25, self.ttl_ms / 4000)):
            try:
                if not self._renew(keys=[key], args=[token, self.ttl_ms]):
                    log.warning("lease %s expired while held (this worker stalled); another may take the part", key)
                    return
            except Exception as exc:  # Redis briefly away: the next renewal may get through
                log.warning("renewing lease %s failed: %s", key, exc)
