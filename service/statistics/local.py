"""A worker's local copies of published statistics: in place on file storage, else downloaded once
into ``ENGRAM_CACHE_DIR/stats/`` (:func:`service.storage.local_copies.cached_copy`).

Statistics are content-addressed, so a worker keeps its copies between jobs, as files read one
input group at a time (``STATS_CACHE`` holds open files, not their contents).
"""

from __future__ import annotations

import os
from pathlib import Path

from service.engine.stats_io import StatisticsFile, expand_statistics
from service.statistics.key import statistics_key
from service.storage.local_copies import Holder, cached_copy
from service.storage.lru import ByteLRU

# At most 256 open files, keyed by store and prefix (one process may hold several stores: tests do).
STATS_CACHE: ByteLRU[StatisticsFile] = ByteLRU(256, lambda _: 1)


def statistics(ctx: Holder, prefix: str) -> StatisticsFile:
    """The statistics file of ``prefix`` on this machine, opened once per process."""
    key = f"{ctx.storage.location}|{prefix}"
    cached = STATS_CACHE.get(key)
    if cached is None or not cached.path.exists():  # another process may have trimmed the disk cache
        cached = STATS_CACHE[key] = StatisticsFile(local_statistics_file(ctx, prefix))
    return cached


def local_statistics_file(ctx: Holder, prefix: str) -> Path:
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

    in_use = {cached.path for k in STATS_CACHE if (cached := STATS_CACHE.get(k)) is not None}
    return cached_copy(ctx, "stats", prefix, fetch, keep=in_use)
