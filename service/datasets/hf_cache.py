"""The hub dataset download cache under ``ENGRAM_CACHE_DIR/hf-datasets``, kept within
``ENGRAM_HF_DATASETS_CACHE_BYTES`` by :func:`trim_hf_cache`, least recently used files first."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

log = logging.getLogger(__name__)

HF_CACHE = "hf-datasets"  # under ENGRAM_CACHE_DIR


def trim_hf_cache(folder: Path, budget: int, keep: set[Path]) -> list[Path]:
    """Delete a hub cache's least recently used files until it holds at most ``budget`` bytes.

    The files are each repository's ``blobs/`` (and plain files in ``snapshots/``, as in a cache
    filled by hand); refs, locks and downloads in progress (``*.incomplete``) are never touched.
    "Used" is the mtime, which :func:`service.datasets.sources.open_source` sets on every file a job reads. A snapshot link
    left dangling is removed with its blob, so the hub client downloads the file again when asked.

    Args:
        keep: files that stay whatever their age (the one the current job reads), even when they
            alone are over the budget.

    Returns:
        The deleted files, least recently used first.
    """
    folder = folder.resolve()
    keep = {p.resolve() for p in keep}
    files = _cached_files(folder)
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, path in files:
        if total <= budget:
            break
        if path in keep:
            continue
        path.unlink(missing_ok=True)
        total -= size
        removed.append(path)
    if removed:
        _drop_dangling_links(folder)
        log.info("hub dataset cache %s: %d files deleted, %d bytes kept (budget %d)", folder, len(removed), total, budget)
    return removed


def _cached_files(folder: Path) -> list[tuple[int, int, Path]]:
    """``(mtime_ns, size, path)`` of every downloaded file of a hub cache, least recently used first."""
    found = []
    for repo in folder.glob("datasets--*"):
        for path in [*repo.glob("blobs/*"), *repo.glob("snapshots/**/*")]:
            if path.name.endswith(".incomplete"):
                continue  # another process is downloading it
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue  # another process trimmed it
            if stat.S_ISREG(info.st_mode):
                found.append((info.st_mtime_ns, info.st_size, path))
    return sorted(found)


def _drop_dangling_links(folder: Path) -> None:
    for link in folder.glob("datasets--*/snapshots/**/*"):
        if link.is_symlink() and not link.exists():
            link.unlink(missing_ok=True)
