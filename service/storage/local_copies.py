"""What a job reads from this machine's disk: immutable stored objects (statistics files, a universe's
factors and engrams), in place on file storage, else downloaded once into ``ENGRAM_CACHE_DIR``
(the model's folder: :mod:`service.models.loaded`).

Statistics and universes are content-addressed, so a worker keeps its local copies between jobs:
statistics as files read one input group at a time (``STATS_CACHE`` holds open files, not their
contents), universe parts as files read one layer or group at a time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from service.config import Settings
from service.engine.stats_io import StatisticsFile, expand_statistics
from service.storage.base import Storage
from service.storage.lru import ByteLRU


class Holder(Protocol):
    """What these copies need of a process's context (:class:`service.context.Context` has it):
    the storage to read from, and the settings naming the cache folder and its budget."""

    storage: Storage
    settings: Settings


STATS_CACHE: ByteLRU[StatisticsFile] = ByteLRU(256, lambda _: 1)  # at most 256 open files


def statistics(ctx: Holder, prefix: str) -> StatisticsFile:
    """The statistics file of ``prefix`` on this machine, opened once per process."""
    key = f"{ctx.storage.location}|{prefix}"  # one process may hold several stores (tests do)
    cached = STATS_CACHE.get(key)
    if cached is None or not cached.path.exists():  # another process may have trimmed the disk cache
        cached = STATS_CACHE[key] = StatisticsFile(local_statistics_file(ctx, prefix))
    return cached


def local_statistics_file(ctx: Holder, prefix: str) -> Path:
    """The statistics file on this machine, ready for per-group reads: in place (file storage) or
    downloaded once to the cache; a file with low-rank ``rows`` groups is expanded into the cache
    once (packed sums), so no variant pays the rows' ``T·D²`` products again."""
    key = prefix + "statistics.safetensors"
    in_place = ctx.storage.local_path(key)
    if in_place is not None and not StatisticsFile(in_place).has_rows:
        return in_place

    def fetch(partial: Path) -> None:
        if in_place is not None:  # a rows file (checked above): expand it, never move the stored object
            expand_statistics(in_place, partial)
            return
        downloaded = partial.with_suffix(".download")
        try:
            ctx.storage.download(key, downloaded)
            if StatisticsFile(downloaded).has_rows:
                expand_statistics(downloaded, partial)
            else:
                os.replace(downloaded, partial)
        finally:
            downloaded.unlink(missing_ok=True)

    in_use = {cached.path for k in STATS_CACHE if (cached := STATS_CACHE.get(k)) is not None}
    return _cached_copy(ctx, "stats", prefix, fetch, keep=in_use)


def local_object(ctx: Holder, key: str, folder: str = "universes") -> Path:
    """An immutable stored object as a local file: in place on file storage, else downloaded once
    into ``ENGRAM_CACHE_DIR/<folder>/`` (kept, within ``ENGRAM_STATS_DISK_CACHE_BYTES``)."""
    in_place = ctx.storage.local_path(key)
    if in_place is not None:
        return in_place
    return _cached_copy(ctx, folder, key, lambda partial: ctx.storage.download(key, partial), keep=set())


def _cached_copy(ctx: Holder, folder_name: str, name: str, fetch: Callable[[Path], None], keep: set[Path]) -> Path:
    """``ENGRAM_CACHE_DIR/<folder_name>/<hash of name>.safetensors``, made by ``fetch`` once, atomically."""
    folder = ctx.settings.cache_dir / folder_name
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{hashlib.sha256(name.encode()).hexdigest()[:40]}.safetensors"
    if target.exists():
        return target
    partial = folder / f".{target.name}.{os.getpid()}.{threading.get_ident()}.part"
    try:
        fetch(partial)
        os.replace(partial, target)  # atomic: a reader sees the whole file or none
    finally:
        partial.unlink(missing_ok=True)
    trim_disk_cache(folder, ctx.settings.stats_disk_cache_bytes, keep=keep | {target})
    return target


def trim_disk_cache(folder: Path, budget: int, keep: set[Path]) -> None:
    """Delete the least recently modified files beyond ``budget`` bytes, but not those this process
    has open (``keep``: the new file and every file in ``STATS_CACHE``)."""
    files = sorted((p for p in folder.glob("*.safetensors") if p not in keep), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in keep if p.exists()) + sum(p.stat().st_size for p in files)
    for path in files:
        if total <= budget:
            return
        total -= path.stat().st_size
        path.unlink(missing_ok=True)
