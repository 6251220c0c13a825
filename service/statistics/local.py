"""A worker's local copies of published statistics: in place on file storage, else downloaded once
into ``ENGRAM_CACHE_DIR/stats/`` (:func:`service.storage.local_copies.cached_copy`).

Statistics are content-addressed, so a worker keeps its copies between jobs, as files read one
input group at a time (the Context's ``caches.stats_files`` holds open files, not their contents).
"""

from __future__ import annotations

import os
from pathlib import Path

from service.context import Context
from service.engine.stats_io import StatisticsFile, expand_statistics
from service.statistics.key import statistics_key
from service.storage.local_copies import cached_copy


def statistics(ctx: Context, prefix: str) -> StatisticsFile:
    """The statistics file of ``prefix`` on this machine, opened once per process and store."""
    cached: StatisticsFile | None = ctx.caches.stats_files.get(ctx.storage, prefix)
    if cached is None or not cached.path.exists():  # another process may have trimmed the disk cache
        cached = ctx.caches.stats_files.put(ctx.storage, prefix, StatisticsFile(local_statistics_file(ctx, prefix)))
    return cached


def local_statistics_file(ctx: Context, prefix: str) -> Path:
    """The statistics file on this machine, ready for per-group reads: in place (file storage) or
    downloaded once to the cache; a file with low-rank ``rows`` groups is expanded into the cache
    once (packed sums), so no variant pays the rows' ``T·D²`` products again."""
    key = statistics_key(prefix)
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

    in_use = {cached.path for cached in ctx.caches.stats_files.values()}
    return cached_copy(ctx, "stats", prefix, fetch, keep=in_use)
