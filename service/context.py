"""The Context: what request handlers and job bodies share, built once per process by :mod:`service.execution.runtime`.

It sits above the job store (it carries one) and below every domain; :mod:`service.jobs` takes what
it needs of a context as a Protocol and never imports this module, so the import goes one way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from service.config import Settings
from service.jobs.records import JobRecord
from service.jobs.store import JobStore
from service.storage.base import Storage
from service.storage.lru import ByteLRU
from service.storage.read_cache import ReadCache

Dispatch = Callable[[JobRecord], None]  # hands a created job to whatever runs it
UniverseHelpers = Callable[[str, str, int], None]  # (universe_id, job_id, count)
RunInline = Callable[["Context", str], None]  # (ctx, job_id): runs a created job in the calling job's process

V = TypeVar("V")

# Entries, not bytes: a statistics header is a few kilobytes, an open statistics file a descriptor.
STATS_HEADER_ENTRIES = 4096
STATS_FILE_ENTRIES = 256


class StoreCache(Generic[V]):
    """Values kept by (store, key), most recently used first, within a byte budget.

    Keyed by the store's :attr:`~service.storage.base.Storage.location` with the key: one process
    may hold several stores (tests do), and two stores' objects under one key, or two stores whose
    keys share a prefix, never share an entry.
    """

    def __init__(self, max_bytes: int, size_of: Callable[[V], int]) -> None:
        self._lru: ByteLRU[V] = ByteLRU(max_bytes, size_of)

    def get(self, storage: Storage, key: str) -> V | None:
        return self._lru.get((storage.location, key))

    def put(self, storage: Storage, key: str, value: V) -> V:
        self._lru[(storage.location, key)] = value
        return value

    def values(self) -> list[V]:
        """What is held now, of every store."""
        return [value for key in self._lru if (value := self._lru.get(key)) is not None]

    def of(self, storage: Storage) -> MutableMapping[Hashable, V]:
        """The entries of one store, as a mapping (what :class:`service.engine.arithmetic.EngramAlgebra` takes)."""
        return _OneStore(self._lru, storage.location)


class _OneStore(MutableMapping[Hashable, V]):
    def __init__(self, lru: ByteLRU[V], location: str) -> None:
        self._lru, self._location = lru, location

    def __getitem__(self, key: Hashable) -> V:
        return self._lru[(self._location, key)]

    def __setitem__(self, key: Hashable, value: V) -> None:
        self._lru[(self._location, key)] = value

    def __delitem__(self, key: Hashable) -> None:
        del self._lru[(self._location, key)]

    def __iter__(self) -> Iterator[Hashable]:
        return iter([key[1] for key in self._lru if isinstance(key, tuple) and key[0] == self._location])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class LoadedCache(Generic[V]):
    """The last ``capacity`` loaded objects (models, variants) by key, most recently used kept.

    Room is made before a load, not after: a model-sized object is never held beside the
    ``capacity`` others while the next one loads. One load at a time (the lock is held while
    ``load`` runs): two jobs asking for the same model load it once.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_load(self, key: Hashable, load: Callable[[], V]) -> V:
        """The object under ``key``, loaded by ``load`` on first use (or after it was dropped)."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            while self._items and len(self._items) >= self.capacity:
                self._items.popitem(last=False)
            value = self._items[key] = load()
            return value

    def resize(self, capacity: int) -> None:
        """Keep at most ``capacity`` objects from now on (the least recently used dropped now)."""
        with self._lock:
            self.capacity = capacity
            while len(self._items) > capacity:
                self._items.popitem(last=False)

    def keys(self) -> list[Hashable]:
        """What is held now, least recently used first."""
        with self._lock:
            return list(self._items)


@dataclass(frozen=True)
class ProcessCaches:
    """What a process keeps between requests and jobs, sized once from the settings.

    Attributes:
        stats_headers: published statistics headers (they never change: nothing goes stale).
        stats_files: open statistics files on this machine (the files, not their contents).
        factors: universes' pseudo-inverse factors for what combines statistics directly (the
            memory-trace maps), within ``ENGRAM_FACTOR_CACHE_BYTES``.
        models: loaded base models with their tokenizers, by checkpoint digest, placement and
            dtype (``ENGRAM_MODEL_CACHE_SIZE`` of them): a worker reuses its model between jobs.
        variants: the last loaded variant (one: a model-sized object each).
    """

    stats_headers: StoreCache[Any]
    stats_files: StoreCache[Any]
    factors: StoreCache[Any]
    models: LoadedCache[Any]
    variants: LoadedCache[Any]

    @classmethod
    def from_settings(cls, settings: Settings) -> ProcessCaches:
        return cls(
            stats_headers=StoreCache(STATS_HEADER_ENTRIES, lambda _: 1),
            stats_files=StoreCache(STATS_FILE_ENTRIES, lambda _: 1),
            factors=StoreCache(settings.factor_cache_bytes, lambda factor: int(factor.nbytes)),
            models=LoadedCache(settings.model_cache_size),
            variants=LoadedCache(1),
        )


@dataclass
class Context:
    """Settings, storage, jobs and the job dispatcher of this process, and what distributed mode adds.

    Attributes:
        dispatch: runs a created job: the embedded job process, a Celery queue, or (a calibration's
            recommended variant) the calling job itself.
        lock: the registry lock, held while a write depends on what was read: a ``threading.RLock``
            (embedded) or a Redis lock shared by every API process (distributed).
        broker_ping: raises when the broker is unreachable (distributed mode).
        queue_depths: ``{queue: waiting jobs}``.
        universe_helpers: asks idle workers to help build a universe (distributed mode).
        live_workers: ``{queue: workers with a live heartbeat consuming it}`` (distributed mode).
        job_process_warm: whether the job process has imported every job body (embedded mode).
        run_inline: runs a created job to its end in this process (the runner sets it for the bodies
            it runs: a calibration runs its recommended variant's job so).
        reads: what status views read: recent documents, not a round trip each.
        shared_caches: another context's caches, to share them (a context copied with
            ``dataclasses.replace`` shares its original's).
        caches: this process's caches (:class:`ProcessCaches`): ``shared_caches``, else built once
            from the settings.
    """

    settings: Settings
    storage: Storage
    jobs: JobStore
    dispatch: Dispatch
    lock: AbstractContextManager[Any]
    broker_ping: Callable[[], Any] | None = None
    queue_depths: Callable[[], dict[str, int]] | None = None
    universe_helpers: UniverseHelpers | None = None
    live_workers: Callable[[], dict[str, int]] | None = None
    job_process_warm: Callable[[], bool] | None = None
    run_inline: RunInline | None = None
    shared_caches: ProcessCaches | None = None
    reads: ReadCache = field(init=False)
    caches: ProcessCaches = field(init=False)

    def __post_init__(self) -> None:
        self.reads = ReadCache(self.storage)
        self.caches = self.shared_caches or ProcessCaches.from_settings(self.settings)
        self.shared_caches = self.caches  # what dataclasses.replace passes on: a copy shares them

    @property
    def cache_dir(self) -> Path:
        """Where checkpoints from s3:// and hf:// sources are downloaded (ENGRAM_CACHE_DIR)."""
        return self.settings.cache_dir
