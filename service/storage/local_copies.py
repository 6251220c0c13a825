"""What a job reads from this machine's disk: immutable stored objects (a universe's factors and
engrams; statistics through :mod:`service.statistics.local`, which knows their format), in place on
file storage, else downloaded once into ``ENGRAM_CACHE_DIR`` (the model's folder:
:mod:`service.models.loaded`).

They are content-addressed, so a worker keeps its local copies between jobs, within
``ENGRAM_STATS_DISK_CACHE_BYTES`` per folder.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from service.config import Settings
from service.storage.base import Storage


class Holder(Protocol):
    """What these copies need of a process's context (:class:`service.context.Context` has it):
    the storage to read from, and the settings naming the cache folder and its budget."""

    storage: Storage
    settings: Settings


def local_object(ctx: Holder, key: str, folder: str = "universes") -> Path:
    """An immutable stored object as a local file: in place on file storage, else downloaded once
    into ``ENGRAM_CACHE_DIR/<folder>/`` (kept, within ``ENGRAM_STATS_DISK_CACHE_BYTES``)."""
    in_place = ctx.storage.local_path(key)
    if in_place is not None:
        return in_place
    return cached_copy(ctx, folder, key, lambda partial: ctx.storage.download(key, partial), keep=set())


def cached_copy(ctx: Holder, folder_name: str, name: str, fetch: Callable[[Path], None], keep: set[Path]) -> Path:
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
    has open (``keep``: the new file and, for statistics, every file the Context's
    ``caches.stats_files`` holds)."""
    files = sorted((p for p in folder.glob("*.safetensors") if p not in keep), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in keep if p.exists()) + sum(p.stat().st_size for p in files)
    for path in files:
        if total <= budget:
            return
        total -= path.stat().st_size
        path.unlink(missing_ok=True)
