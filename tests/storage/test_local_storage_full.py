"""A local store whose file system refuses writes: full, over quota, read-only.

Filling or remounting a real file system needs root (``tests/api/test_lifecycle_sweep.py`` does it
on a tmpfs when it may), so these tests stand in the file system's refusal at its boundary: the
copy, write or unlink raises the ``OSError`` the kernel would.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from service.storage.base import StorageUnavailable
from service.storage.local import LocalStorage


def _refuse(code: int) -> Callable[..., None]:
    """A stand-in for the copy, write or unlink that fails as the kernel would with ``code``."""

    def refuse(*_: object, **__: object) -> None:
        raise OSError(code, os.strerror(code))

    return refuse


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES])
def test_a_refused_write_is_storage_unavailable_naming_why_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    storage = LocalStorage(tmp_path / "store")
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 100)
    monkeypatch.setattr(shutil, "copyfile", _refuse(code))
    monkeypatch.setattr(Path, "write_bytes", _refuse(code))
    for write in (lambda: storage.put_file("a/b.bin", source), lambda: storage.put_bytes("a/c.json", b"{}")):
        with pytest.raises(StorageUnavailable, match=os.strerror(code)):
            write()
    assert storage.list("a/") == []
    assert list(storage.tmp_dir.iterdir()) == []


def test_a_refused_delete_is_storage_unavailable_and_keeps_the_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = LocalStorage(tmp_path / "store")
    storage.put_bytes("kept.json", b"{}")
    monkeypatch.setattr(Path, "unlink", _refuse(errno.EROFS))
    with pytest.raises(StorageUnavailable, match="Read-only file system"):
        storage.delete("kept.json")
    assert storage.get_bytes("kept.json") == b"{}"


def test_other_os_errors_are_not_disguised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = LocalStorage(tmp_path / "store")
    monkeypatch.setattr(Path, "write_bytes", _refuse(errno.EIO))
    with pytest.raises(OSError, match="Input/output error") as caught:
        storage.put_bytes("a.json", b"{}")
    assert not isinstance(caught.value, StorageUnavailable)
