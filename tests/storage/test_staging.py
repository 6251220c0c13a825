"""Staging folders and moves (issue 27): a job's files are written where the store can take them in
one step, and publishing one consumes it. On ``file://`` that is a rename on the store's volume (the
published file is the very inode written: no byte copied); on S3 an upload of the file as written.
Either way nothing is left in the staging folder or beside it, and a staging folder is gone after
its block, whatever happened in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.storage.base import Storage, owner_tag
from service.storage.janitor import STORAGE_TMP
from service.storage.local import LocalStorage

DATA = os.urandom(6 * 1024 * 1024 + 17)  # above the tests' S3 multipart threshold (5 MiB)


def test_a_staged_file_is_published_whole_and_consumed(storage: Storage) -> None:  # noqa: F811
    with storage.staging_dir("variant") as tmp:
        folder = Path(tmp)
        file = folder / "model.safetensors"
        file.write_bytes(DATA)
        storage.move_file("variants/v1/files/model.safetensors", file)
        assert not file.exists() and list(folder.iterdir()) == []
    assert not folder.exists()
    assert storage.get_bytes("variants/v1/files/model.safetensors") == DATA
    assert storage.list("variants/") == ["variants/v1/files/model.safetensors"], "the staging folder is no object"


def test_on_local_storage_the_move_is_a_rename_on_the_stores_volume(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    with store.staging_dir("variant") as tmp:
        folder = Path(tmp)
        assert folder.parent == store.tmp_dir and STORAGE_TMP.match(folder.name), "the janitor knows its name"
        assert folder.name.startswith(owner_tag() + ".")
        file = folder / "model.safetensors"
        file.write_bytes(DATA)
        inode = file.stat().st_ino
        store.move_file("variants/v1/files/model.safetensors", file)
    published = store.local_path("variants/v1/files/model.safetensors")
    assert published is not None and published.stat().st_ino == inode, "renamed, not copied"
    assert list(store.tmp_dir.iterdir()) == []


def test_a_staging_folder_is_removed_when_its_block_fails(storage: Storage) -> None:  # noqa: F811
    made: list[Path] = []

    def write_half_then_fail() -> None:
        with storage.staging_dir("variant") as tmp:
            made.append(Path(tmp))
            (Path(tmp) / "half.safetensors").write_bytes(DATA[:100])
            raise RuntimeError("mid-write")

    with pytest.raises(RuntimeError, match="mid-write"):
        write_half_then_fail()
    assert made and not made[0].exists()
    assert storage.list("") == []
