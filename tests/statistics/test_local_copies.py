"""Workers read statistics from local files: in place on file storage, else downloaded once;
files holding low-rank ``rows`` groups are expanded once into the cache (packed sums)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from service.config import Settings
from service.context import Context
from service.engine.collect import LayerStatistics
from service.engine.linalg import gram, pack_symmetric
from service.engine.stats_io import StatisticsFile, save_statistics
from service.statistics.local import local_statistics_file
from service.storage.local import LocalStorage
from service.storage.local_copies import trim_disk_cache


class RemoteLikeStorage(LocalStorage):
    """Real local storage that, like S3, offers no in-place path and counts its downloads."""

    downloads = 0

    def local_path(self, key: str) -> Path | None:
        return None

    def download(self, key: str, target: Path) -> None:
        RemoteLikeStorage.downloads += 1
        super().download(key, target)


def _context(storage: LocalStorage, cache: Path, budget: int = 1 << 30) -> Context:
    settings = Settings(cache_dir=cache, stats_disk_cache_bytes=budget)
    return Context(settings=settings, storage=storage, jobs=None, dispatch=None, lock=None)  # type: ignore[arg-type]


def _store(storage: LocalStorage, tmp_path: Path, prefix: str, tokens: int, dim: int = 16) -> LayerStatistics:
    """A real statistics file of one 16-wide group: ``rows`` form when ``tokens < 16``."""
    rows = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(tokens))
    stats = LayerStatistics({"g": gram(rows)}, {"g": tokens}, {"layer": "g"}, {"g": rows})
    file = tmp_path / f"{prefix.strip('/').replace('/', '-')}.safetensors"
    save_statistics(stats, file)
    storage.put_file(prefix + "statistics.safetensors", file)
    return stats


def test_file_storage_is_read_in_place(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    _store(storage, tmp_path, "stats/a/", tokens=40)
    path = local_statistics_file(_context(storage, tmp_path / "cache"), "stats/a/")
    assert path == tmp_path / "store" / "stats/a/statistics.safetensors"
    assert not (tmp_path / "cache" / "stats").exists()


def test_remote_statistics_are_downloaded_once_and_whole(tmp_path: Path) -> None:
    storage = RemoteLikeStorage(tmp_path / "store")
    _store(storage, tmp_path, "stats/b/", tokens=40)
    ctx = _context(storage, tmp_path / "cache")
    before = RemoteLikeStorage.downloads
    first = local_statistics_file(ctx, "stats/b/")
    again = local_statistics_file(ctx, "stats/b/")
    assert first == again and first.read_bytes() == storage.get_bytes("stats/b/statistics.safetensors")
    assert RemoteLikeStorage.downloads == before + 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no partial file left behind


def test_rows_files_are_expanded_once_into_the_cache(tmp_path: Path) -> None:
    for storage in (LocalStorage(tmp_path / "local"), RemoteLikeStorage(tmp_path / "remote")):
        stats = _store(storage, tmp_path, "stats/c/", tokens=5)
        stored = storage.get_bytes("stats/c/statistics.safetensors")
        cache = tmp_path / f"cache-{type(storage).__name__}"
        path = local_statistics_file(_context(storage, cache), "stats/c/")
        assert path.parent == cache / "stats", "never read in place: every read would pay XᵀX"
        local = StatisticsFile(path)
        assert not local.has_rows and torch.equal(local.sums["g"], pack_symmetric(stats.sums["g"]))
        assert storage.get_bytes("stats/c/statistics.safetensors") == stored, "the stored file is untouched"
        assert local_statistics_file(_context(storage, cache), "stats/c/") == path
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial or download left


def test_disk_cache_drops_the_oldest_files_beyond_its_budget(tmp_path: Path) -> None:
    folder = tmp_path / "stats"
    folder.mkdir()
    now = time.time()
    for age, name in enumerate(["new", "mid", "old"]):
        path = folder / f"{name}.safetensors"
        path.write_bytes(b"z" * 100)
        os.utime(path, (now - 100 * age, now - 100 * age))
    keep = folder / "just-downloaded.safetensors"
    keep.write_bytes(b"k" * 100)
    os.utime(keep, (now - 1000, now - 1000))  # even when it looks oldest, the file in use stays
    trim_disk_cache(folder, budget=250, keep={keep})
    assert sorted(p.stem for p in folder.iterdir()) == ["just-downloaded", "new"]


def test_two_stores_in_one_process_keep_their_own_statistics(tmp_path: Path) -> None:
    """The process-wide caches key by the store as well as the key: the same prefix in two stores
    (two test worlds, or two contexts) may hold different bytes, and each context reads its own."""
    from service.statistics.local import statistics

    first, second = LocalStorage(tmp_path / "one"), LocalStorage(tmp_path / "two")
    _store(first, tmp_path / "one", "stats/same/", tokens=40, dim=16)
    _store(second, tmp_path / "two", "stats/same/", tokens=41, dim=16)
    one = statistics(_context(first, tmp_path / "cache1"), "stats/same/")
    two = statistics(_context(second, tmp_path / "cache2"), "stats/same/")
    assert one.path != two.path
    assert not torch.equal(one.sums["g"], two.sums["g"])
    assert first.location != second.location


def test_one_process_cache_keeps_two_stores_with_the_same_prefix_apart(tmp_path: Path) -> None:
    """Two contexts sharing one :class:`ProcessCaches` (as a process's copies of its Context do):
    the statistics files, their headers and the factors of the same prefix in two stores are two entries."""
    from service.statistics.local import statistics
    from service.statistics.manifest import stats_header

    first, second = LocalStorage(tmp_path / "one"), LocalStorage(tmp_path / "two")
    _store(first, tmp_path / "one", "stats/same/", tokens=40, dim=16)
    _store(second, tmp_path / "two", "stats/same/", tokens=41, dim=8)
    one, two = _context(first, tmp_path / "cache"), _context(second, tmp_path / "cache")
    shared = dataclasses.replace(two, shared_caches=one.caches)
    assert shared.caches is one.caches
    files = statistics(one, "stats/same/"), statistics(shared, "stats/same/")
    assert files[0].path != files[1].path and not torch.equal(files[0].sums["g"], files[1].sums["g"])
    assert (stats_header(one, "stats/same/").dims, stats_header(shared, "stats/same/").dims) == ({"g": 16}, {"g": 8})
    one.caches.factors.of(first)["u"] = torch.zeros(2)
    assert "u" not in one.caches.factors.of(second) and list(one.caches.factors.of(first)) == ["u"]
    assert statistics(one, "stats/same/") is files[0]  # the same store and key: one entry, kept
    assert dataclasses.replace(one).caches is one.caches  # a copy of a context shares its caches
