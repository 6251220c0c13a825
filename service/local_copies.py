"""What a job reads from this machine's disk: the checked model folder and immutable stored objects
(statistics files, a universe's factors and engrams), in place on file storage, else downloaded
once into ``ENGRAM_CACHE_DIR``.

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
from typing import Any

from service.engine.checkpoint import directory_digest
from service.engine.model_files import SIDE_FILES, ModelSourceError, check_links
from service.engine.stats_io import StatisticsFile, expand_statistics
from service.errors import JobFailed
from service.registry import Context, file_fingerprint
from service.sources import local_model_dir
from service.storage.lru import ByteLRU

_VERIFIED: dict[str, str] = {}  # local copy of a remote source -> its verified digest


def checked_model_dir(ctx: Context, manifest: dict[str, Any]) -> Path:
    """This process's directory of the model, after checking it holds the registered files.

    A ``file://`` model is read in place (its sizes and mtimes must be as registered). A remote
    one (``s3://``, ``hf://``) is fetched into this machine's cache, which need not be the API's,
    and its content digest checked once per process.

    Either way the folder passes :mod:`service.engine.model_files`' rules again first (no link
    leading out of it, plain shard names), so a link swapped in since registration fails the job
    before any file is read or copied.
    """
    model_id = manifest["model_id"]
    try:
        if manifest["source"].startswith("file://"):
            path = Path(manifest["path"])
            if not path.is_dir() or not _unchanged(path, manifest):
                raise JobFailed(f"the files of model {model_id} changed since registration; register it again")
            return path
        path = local_model_dir(manifest["source"], [], ctx.cache_dir, ctx.settings.s3_endpoint_url)
        digest = manifest["digest"]
        if _VERIFIED.get(str(path)) != digest:
            check_links(path)
            # Registrations made before the allowlist hashed every in-folder file: accept their digest too.
            if directory_digest(path) != digest and directory_digest(path, every_file=True) != digest:
                raise JobFailed(f"the source of model {model_id} changed since registration; register it again")
            _VERIFIED[str(path)] = digest
        return path
    except ModelSourceError as exc:
        raise JobFailed(f"the files of model {model_id} are refused: {exc}; register it again") from None


def _unchanged(path: Path, manifest: dict[str, Any]) -> bool:
    """Whether the files the service uses from ``path`` are as registered (sizes and mtimes).

    Raises:
        ModelSourceError: the folder breaks a rule of :mod:`service.engine.model_files`.
    """
    if path.resolve() != path:  # registered resolved: the folder, or a folder above it, became a link
        raise ModelSourceError("the model folder was replaced by a symbolic link")
    check_links(path)
    current = file_fingerprint(path)
    return current == _registered_fingerprint(manifest, current)


def _registered_fingerprint(manifest: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The registered sizes and mtimes of the files the service uses. Registrations made before the
    allowlist listed every file of the folder; the others (a README) are not compared."""
    shards = set(manifest["layout"]["key_files"].values())
    return {k: v for k, v in manifest["fingerprint"].items() if k in SIDE_FILES or k in shards or k in current}


# ---------------------------------------------------------------- statistics

STATS_CACHE: ByteLRU[StatisticsFile] = ByteLRU(256, lambda _: 1)  # at most 256 open files


def statistics(ctx: Context, prefix: str) -> StatisticsFile:
    """The statistics file of ``prefix`` on this machine, opened once per process."""
    cached = STATS_CACHE.get(prefix)
    if cached is None or not cached.path.exists():  # another process may have trimmed the disk cache
        cached = STATS_CACHE[prefix] = StatisticsFile(local_statistics_file(ctx, prefix))
    return cached


def local_statistics_file(ctx: Context, prefix: str) -> Path:
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


def local_object(ctx: Context, key: str, folder: str = "universes") -> Path:
    """An immutable stored object as a local file: in place on file storage, else downloaded once
    into ``ENGRAM_CACHE_DIR/<folder>/`` (kept, within ``ENGRAM_STATS_DISK_CACHE_BYTES``)."""
    in_place = ctx.storage.local_path(key)
    if in_place is not None:
        return in_place
    return _cached_copy(ctx, folder, key, lambda partial: ctx.storage.download(key, partial), keep=set())


def _cached_copy(ctx: Context, folder_name: str, name: str, fetch: Callable[[Path], None], keep: set[Path]) -> Path:
    """``ENGRAM_CACHE_DIR/<folder_name>/<hash of name>.safetensors``, made by ``fetch`` once, atomically."""
    folder = ctx.cache_dir / folder_name
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
