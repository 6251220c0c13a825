"""Object storage behind one interface: what the service needs of a backend, and its errors.

Keys are ``/``-separated strings (spelled in :mod:`service.storage.keys`). Every write is atomic: a
reader sees a whole object or none (:mod:`service.storage.local` renames a temporary file into
place; :mod:`service.storage.s3` has S3's own atomic PUT). Multi-object artifacts (statistics,
variants) publish a manifest last; an artifact exists exactly when its manifest does.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# Names every temporary file and folder with its owner, so that service.storage.janitor can tell a live
# process's from a crashed one's (pids alone are ambiguous where machines share a volume).
HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def owner_tag() -> str:
    """``<pid>.<host tag>``: part of the name of every temporary file or folder this process makes."""
    return f"{os.getpid()}.{HOST_TAG}"


class ObjectNotFound(KeyError):
    """The key does not exist."""


class StorageUnavailable(RuntimeError):
    """The backend cannot be reached right now (a 503, and a retry for jobs)."""


class StreamedUpload(ABC):
    """An object uploaded while its local file is still being written: told the file's bytes in
    order (:meth:`update`), published whole by :meth:`complete` (never visible in part), or dropped
    by :meth:`abort`. The writer keeps each buffer it passes alive and unchanged (as it does for its
    hash) until the upload has taken it."""

    @abstractmethod
    def update(self, data: memoryview) -> None:
        """The next bytes of the object; raises what the upload met so far (the writer stops early)."""

    @abstractmethod
    def complete(self, size: int) -> None:
        """Publish the object, after checking that ``size`` bytes (what the file holds) were told."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was uploaded; safe to call twice or after :meth:`complete` failed."""


@runtime_checkable
class Presigning(Protocol):
    """A store that can hand out a URL to GET an object from directly (S3); the local store cannot."""

    def presigned_url(self, key: str, expires_s: int) -> str: ...


class Storage(ABC):
    """What the service needs from object storage."""

    @property
    def location(self) -> str:
        """Where this store keeps its objects (a directory or a bucket URL). Process-wide caches of
        content-addressed objects key by it with the object's key: one process may hold several
        stores (tests do), and two stores' objects under one key need not be the same bytes."""
        return repr(self)

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

    def staging_dir(self, prefix: str) -> AbstractContextManager[str]:
        """A private folder, removed with its context, to write files that :meth:`move_file` then
        publishes: where publishing can be a rename (local storage: a folder on the store's own
        volume), else a scratch folder (:func:`scratch_dir`) from which each file is uploaded."""
        return scratch_dir(prefix)

    def streamed_upload(self, key: str) -> StreamedUpload | None:
        """An upload of ``key`` fed while its file is written, where publishing a written file is
        itself a copy (S3: the upload then overlaps the write instead of following it); None where
        :meth:`move_file` is a rename, or the backend has no such upload."""
        return None

    def move_file(self, key: str, source: Path) -> None:
        """Atomically publish ``source`` (a file of a :meth:`staging_dir` folder) under ``key``; the
        file is consumed: renamed into place where the backend can, else uploaded (S3: a multipart
        upload above its threshold) and deleted, so no second local copy is ever made."""
        self.put_file(key, source)
        source.unlink(missing_ok=True)

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


def scratch_dir(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A private working directory that disappears with its context, whatever happens short of a
    crash: ``engram-<prefix>.<owner tag>.<random>``, which :mod:`service.storage.janitor` removes once its
    process is gone."""
    return tempfile.TemporaryDirectory(prefix=f"engram-{prefix}.{owner_tag()}.")
