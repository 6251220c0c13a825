"""Workers read statistics from local files: in place on file storage, else downloaded once."""

from __future__ import annotations

import os
import time
from pathlib import Path

from service.config import Settings
from service.registry import Context
from service.storage import LocalStorage
from service.tasks import _local_statistics_file, _trim_disk_cache


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


def test_file_storage_is_read_in_place(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    storage.put_bytes("stats/a/statistics.safetensors", b"x" * 10)
    path = _local_statistics_file(_context(storage, tmp_path / "cache"), "stats/a/")
    assert path == tmp_path / "store" / "stats/a/statistics.safetensors"
    assert not (tmp_path / "cache" / "stats").exists()


def test_remote_statistics_are_downloaded_once_and_whole(tmp_path: Path) -> None:
    storage = RemoteLikeStorage(tmp_path / "store")
    storage.put_bytes("stats/b/statistics.safetensors", b"y" * 1000)
    ctx = _context(storage, tmp_path / "cache")
    before = RemoteLikeStorage.downloads
    first = _local_statistics_file(ctx, "stats/b/")
    again = _local_statistics_file(ctx, "stats/b/")
    assert first == again and first.read_bytes() == b"y" * 1000
    assert RemoteLikeStorage.downloads == before + 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no partial file left behind


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
    _trim_disk_cache(folder, budget=250, keep={keep})
    assert sorted(p.stem for p in folder.iterdir()) == ["just-downloaded", "new"]
