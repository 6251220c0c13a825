"""Recent reads of small JSON documents, so a status poll does not cost a storage round trip.

Two kinds of document are read by every poll:

- immutable ones (a published statistics or variant manifest: content-addressed, written once):
  once found, kept until evicted; "not there yet" is never cached, so publication shows at once;
- mutable ones (a concept, a variant's request, a listing): kept ``ttl_s`` seconds. This process's
  own writes drop the entry at once; another process's writes show within ``ttl_s``.

Only views read through this cache. Anything that decides a write (submitting a concept or a
variant) reads storage directly, under the registry lock.

Documents are read strictly (:func:`service.storage.stored_json.find_record`): one that is not a
JSON object raises :class:`~service.storage.stored_json.UnreadableRecord` naming its key, and is
never cached (each read tries storage again, so a repaired record shows at once).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from service.storage.base import Storage
from service.storage.stored_json import find_record

DEFAULT_TTL_S = 1.0
DEFAULT_MAX_ITEMS = 4096


class ReadCache:
    def __init__(self, storage: Storage, ttl_s: float = DEFAULT_TTL_S, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self.storage, self.ttl_s, self.max_items = storage, ttl_s, max_items
        self._items: OrderedDict[str, tuple[float, Any]] = OrderedDict()  # key -> (expiry, value)
        self._lock = threading.Lock()

    def immutable_json(self, key: str) -> dict[str, Any] | None:
        """A write-once document: cached once found, looked up again while missing."""
        hit = self._lookup(key)
        if hit is not None:
            return hit[1]
        value = find_record(self.storage, key)
        if value is not None:
            self._store(key, value, float("inf"))
        return value

    def recent_json(self, key: str) -> dict[str, Any] | None:
        """A mutable document as of at most ``ttl_s`` seconds ago (a miss is cached too)."""
        return self._recent(key, lambda: find_record(self.storage, key))

    def recent_listing(self, prefix: str) -> list[str]:
        """``storage.list(prefix)`` as of at most ``ttl_s`` seconds ago."""
        return self._recent("list:" + prefix, lambda: self.storage.list(prefix))

    def peek(self, key: str) -> tuple[bool, Any]:
        """``(True, value)`` when ``key`` is cached and fresh, else ``(False, None)``; never reads storage."""
        hit = self._lookup(key)
        return (False, None) if hit is None else (True, hit[1])

    def forget(self, key: str) -> None:
        """This process changed ``key``: the next read goes to storage (listings containing it too)."""
        with self._lock:
            self._items.pop(key, None)
            for cached in [k for k in self._items if k.startswith("list:") and key.startswith(k[5:])]:
                del self._items[cached]

    def _recent(self, key: str, load: Any) -> Any:
        hit = self._lookup(key)
        if hit is not None:
            return hit[1]
        value = load()
        self._store(key, value, time.monotonic() + self.ttl_s)
        return value

    def _lookup(self, key: str) -> tuple[float, Any] | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None or hit[0] < time.monotonic():
                return None
            self._items.move_to_end(key)
            return hit

    def _store(self, key: str, value: Any, expiry: float) -> None:
        with self._lock:
            self._items[key] = (expiry, value)
            self._items.move_to_end(key)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
