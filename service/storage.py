"""Object storage behind one interface; this module holds the local-filesystem backend.

Keys are ``/``-separated strings. Every write is atomic: the bytes go to a temporary name first and
are renamed into place, so a reader sees a whole object or none. Multi-object artifacts (statistics,
variants) publish a manifest last; an artifact exists exactly when its manifest does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CHUNK = 1024 * 1024
# Names every temporary file and folder with its owner, so that service.janitor can tell a live
# process's from a crashed one's (pids alone are ambiguous where machines share a volume).
HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def owner_tag() -> str:
    """``<pid>.<host tag>``: part of the name of every temporary file or folder this process makes."""
    return f"{os.getpid()}.{HOST_TAG}"


class ObjectNotFound(KeyError):
    """The key does not exist."""


class StorageUnavailable(RuntimeError):
    """The backend cannot be reached right now (a 503, and a retry for jobs)."""


class Storage(ABC):
    """What the service needs from object storage."""

    @abstractmethod
    def put_file(self, key: str, source: Path) -> None:
        """Atomically publish a local file under ``key``."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Atomically publish ``data`` under ``key``."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The object's bytes; raises :class:`ObjectNotFound`."""

    @abstractmethod
    def download(self, key: str, target: Path) -> None:
        """Copy the object to a local file."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix``, sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object (missing is fine)."""

    @abstractmethod
    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` to ``end`` inclusive, in chunks."""

    @abstractmethod
    def ping(self) -> None:
        """Raise :class:`StorageUnavailable` when the backend cannot serve requests."""

    def local_path(self, key: str) -> Path | None:
        """A path to read the object in place, for backends that have one."""
        return None

    def abort_stale_uploads(self, older_than_s: float) -> int:
        """Drop unfinished uploads older than ``older_than_s`` that a crashed writer left (S3's
        multipart uploads); returns how many. Backends that publish by rename have none."""
        return 0

    def put_json(self, key: str, value: Any) -> None:
        self.put_bytes(key, json.dumps(value, sort_keys=True, indent=1).encode())

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_bytes(key))

    def find_json(self, key: str) -> Any | None:
        """The decoded object, or ``None`` when there is none (an invalid key names nothing)."""
        try:
            return self.get_json(key)
        except (ObjectNotFound, ValueError):
            return None

    def delete_prefix(self, prefix: str) -> None:
        for key in self.list(prefix):
            self.delete(key)


class LocalStorage(Storage):
    """Objects as files under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.tmp_dir = self.root / ".tmp"  # files being written, named <owner tag>.<uuid> (service.janitor)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or any(part in {"", ".", ".."} for part in key.split("/")):
            raise ValueError(f"invalid storage key {key!r}")
        if any(len(part.encode()) > 255 for part in key.split("/")):
            raise ObjectNotFound(key)  # no file system can hold such a name, so nothing is stored there
        return self.root / key

    def _publish(self, key: str, write: Any) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.tmp_dir / f"{owner_tag()}.{uuid.uuid4().hex}"
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def put_file(self, key: str, source: Path) -> None:
        self._publish(key, lambda tmp: shutil.copyfile(source, tmp))

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
        self._path(key).unlink(missing_ok=True)

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


def scratch_dir(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A private working directory that disappears with its context, whatever happens short of a
    crash: ``engram-<prefix>.<owner tag>.<random>``, which :mod:`service.janitor` removes once its
    process is gone."""
    return tempfile.TemporaryDirectory(prefix=f"engram-{prefix}.{owner_tag()}.")
