"""A small thread-safe LRU bounded by bytes, for what workers reuse between jobs."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, MutableMapping
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class ByteLRU(MutableMapping[Hashable, V], Generic[V]):
    """Keeps the most recently used values while their total size stays under ``max_bytes``.

    Args:
        max_bytes: the budget; a single value larger than it is not kept at all.
        size_of: the size in bytes of a value.
    """

    def __init__(self, max_bytes: int, size_of: Callable[[V], int]) -> None:
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __getitem__(self, key: Hashable) -> V:
        with self._lock:
            value, _ = self._items[key]
            self._items.move_to_end(key)
            return value

    def __setitem__(self, key: Hashable, value: V) -> None:
        size = self._size_of(value)
        with self._lock:
            self._pop(key)
            if size > self.max_bytes:
                return
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._pop(next(iter(self._items)))

    def __delitem__(self, key: Hashable) -> None:
        with self._lock:
            if key not in self._items:
                raise KeyError(key)
            self._pop(key)

    def __iter__(self) -> Any:
        with self._lock:
            return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def _pop(self, key: Hashable) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= item[1]
