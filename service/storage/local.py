"""The local-filesystem backend: objects as files under one root directory.

Every write is atomic: the bytes go to a temporary file under ``<root>/.tmp/`` (named with its
owner, :func:`service.storage.base.owner_tag`) and are renamed into place, so a reader sees a whole
object or none. Files a job writes for the store (a variant's) are written in a staging folder
there too (:meth:`LocalStorage.staging_dir`), so publishing each is a rename, never a copy. A write
the file system refuses for good reasons of its own (full, over quota, a file too large for it,
read-only, not ours to write) is :class:`StorageUnavailable` naming the reason, as ``ping``
(``/readyz``) says for a folder that is not writable: the operator's to fix, not a bug.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from service.storage.base import ObjectNotFound, Storage, StorageUnavailable, owner_tag

_CHUNK = 1024 * 1024
# errnos by which the file system refuses a write: the operator's to fix (space can be freed, the disk
# remounted), so a 503 to the request and a capped retry to a job, never an internal error
_REFUSED_WRITES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


class LocalStorage(Storage):
    """Objects as files under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.tmp_dir = self.root / ".tmp"  # files being written, named <owner tag>.<uuid> (service.storage.janitor)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)

    @property
    def location(self) -> str:
        return f"file://{self.root}"

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or any(part in {"", ".", ".."} for part in key.split("/")):
            raise ValueError(f"invalid storage key {key!r}")
        if any(len(part.encode()) > 255 for part in key.split("/")):
            raise ObjectNotFound(key)  # no file system can hold such a name, so nothing is stored there
        return self.root / key

    @contextmanager
    def _writing(self, key: str) -> Iterator[None]:
        """Turn the file system's refusal of a write to ``key`` into :class:`StorageUnavailable`."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in _REFUSED_WRITES:
                raise
            raise StorageUnavailable(f"storage directory {self.root} refused to write {key}: {exc.strerror}") from exc

    def _publish(self, key: str, write: Any) -> None:
        target = self._path(key)
        tmp = self.tmp_dir / f"{owner_tag()}.{uuid.uuid4().hex}"
        with self._writing(key):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                write(tmp)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)

    def put_file(self, key: str, source: Path) -> None:
        self._publish(key, lambda tmp: shutil.copyfile(source, tmp))

    def staging_dir(self, prefix: str) -> AbstractContextManager[str]:
        """A folder under ``<root>/.tmp/`` named ``<owner tag>.<uuid hex>`` like the temporary files
        (the janitor removes it once its process is gone), on the store's volume: :meth:`move_file`
        renames its files into place. ``prefix`` names nothing here: the owner tag says whose it is."""
        return _StagingDir(self.tmp_dir / f"{owner_tag()}.{uuid.uuid4().hex}")

    def move_file(self, key: str, source: Path) -> None:
        target = self._path(key)
        with self._writing(key):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(source, target)  # atomic, and no byte is copied
                return
            except OSError as exc:
                if exc.errno != errno.EXDEV:  # a file from another volume is copied instead
                    raise
            self.put_file(key, source)
            source.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._publish(key, lambda tmp: tmp.write_bytes(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFound(key) from None

    def download(self, key: str, target: Path) -> None:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        shutil.copyfile(path, target)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for path in base.rglob("*"):
            if path.is_file() and self.tmp_dir not in path.parents:
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._writing(key):
            path.unlink(missing_ok=True)

    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        with path.open("rb") as handle:
            handle.seek(start)
            remaining = end - start + 1
            while remaining > 0:
                chunk = handle.read(min(_CHUNK, remaining))
                if not chunk:
                    return
                remaining -= len(chunk)
                yield chunk

    def ping(self) -> None:
        if not self.root.is_dir() or not os.access(self.root, os.W_OK):
            raise StorageUnavailable(f"storage directory {self.root} is not writable")

    def local_path(self, key: str) -> Path | None:
        path = self._path(key)
        return path if path.is_file() else None


class _StagingDir(AbstractContextManager[str]):
    """A folder made on entry and removed, with whatever is left in it, on exit."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> str:
        self.path.mkdir(mode=0o700)
        return str(self.path)

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
