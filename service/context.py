"""The Context: what request handlers and job bodies share, built once per process by :mod:`service.execution.runtime`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.config import Settings
from service.jobs.store import JobStore
from service.storage.base import Storage
from service.storage.read_cache import ReadCache

Dispatch = Callable[[dict[str, Any]], None]  # hands a created job to whatever runs it
UniverseHelpers = Callable[[str, str, int], None]  # (universe_id, job_id, count)


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
        reads: what status views read: recent documents, not a round trip each.
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
    reads: ReadCache = field(init=False)

    def __post_init__(self) -> None:
        self.reads = ReadCache(self.storage)

    @property
    def cache_dir(self) -> Path:
        """Where checkpoints from s3:// and hf:// sources are downloaded (ENGRAM_CACHE_DIR)."""
        return self.settings.cache_dir
