"""A model folder's files opened once and read only through their descriptors.

Checking a path and then reading it by name leaves a window in which the name can be pointed at
another file (a link swapped in, a rename over it). Registration and every job therefore open each
file the service uses once (:func:`open_model_files`, the files and rules of
:mod:`service.engine.model_files`): its resolved path one component at a time with ``O_NOFOLLOW``,
a regular file by ``fstat``. The identity of each (:class:`FileIdentity`: size, mtime, inode, ctime)
is recorded at registration from those descriptors and compared by every job; the bytes are then
read only through the descriptors (:class:`ModelFiles`): transformers and safetensors get
``/proc/self/fd/<n>`` paths, which reopen the very file that was checked, so a file swapped between
the check and the read is never the one read.

transformers reads more of a folder than the service asks for (``adapter_config.json``,
``additional_chat_templates/``, …): :func:`clean_view` gives it a private directory holding links
to the checked files and nothing else.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from service.engine.model_files import (
    INDEX_FILE,
    MAX_SIDE_JSON_BYTES,
    ModelSourceError,
    allowed_dirs,
    resolve_file,
    side_files,
    weight_files,
)

_PROC_FD = Path("/proc/self/fd")


@dataclass(frozen=True)
class FileIdentity:
    """What the file system says a file is: size, modification time, inode number and inode change
    time (ns).

    Recorded at registration for every used file and compared at every job, instead of hashing
    the checkpoint again. A file replaced by another (a rename over it, a copy, a link) has a new
    inode; one rewritten in place has a new mtime. A writer can set the mtime back (``os.utime``),
    but not the ctime: the kernel sets it to now on every write and on that ``utime`` itself, so a
    rewrite in place of the same size with its mtime restored is caught too. The price: a
    ``chmod``, ``chown`` or new hard link of a model file also fails its jobs until the model is
    registered again. The device number is left out on purpose: it changes when a volume is
    mounted again.
    """

    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

    def to_json(self) -> list[int]:
        return [self.size, self.mtime_ns, self.inode, self.ctime_ns]

    @classmethod
    def from_json(cls, value: object) -> FileIdentity | None:
        """The identity of a stored ``[size, mtime_ns, inode, ctime_ns]``; ``None`` for anything else
        (an older registration's ``[size, mtime_ns]`` fingerprint)."""
        if not isinstance(value, list) or len(value) != 4 or not all(type(v) is int for v in value):
            return None
        return cls(*value)

    def differences(self, now: FileIdentity) -> str:
        """What changed, in words (``size 10 -> 12, inode 5 -> 9``)."""
        fields = [
            f"{label} {old} -> {new}"
            for label, old, new in (
                ("size", self.size, now.size),
                ("mtime_ns", self.mtime_ns, now.mtime_ns),
                ("inode", self.inode, now.inode),
                ("ctime_ns", self.ctime_ns, now.ctime_ns),
            )
            if old != new
        ]
        return ", ".join(fields) or "unchanged"


class ModelFilesChanged(ModelSourceError):
    """A file of a registered model is not the file that was registered; the message names it."""


class ModelFiles:
    """The files the service uses from one model folder (:func:`~service.engine.model_files.used_files`),
    each opened once.

    Read them only through :meth:`path` (a ``/proc/self/fd`` path of the checked descriptor) or
    :meth:`read`: never by their name in the folder, which may point elsewhere by now. The
    descriptors close with :meth:`close` (or the ``with`` block, or when the object is collected).
    """

    def __init__(self, folder: Path, fds: dict[str, int], reals: dict[str, Path], shards: list[str]) -> None:
        self.folder = folder
        self.shards = shards
        self._fds = dict(sorted(fds.items()))
        self._reals = reals
        self._identity = {name: FileIdentity.of(os.fstat(fd)) for name, fd in self._fds.items()}
        self._closer = weakref.finalize(self, _close_all, list(self._fds.values()))

    def __enter__(self) -> ModelFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closer()

    @property
    def names(self) -> list[str]:
        return list(self._fds)

    def has(self, name: str) -> bool:
        return name in self._fds

    def path(self, name: str) -> Path:
        """A path that opens the checked file itself (where ``/proc`` is missing, as on macOS: the
        file's resolved path, which keeps the checks made when it was opened but not the pinning)."""
        if name not in self._fds:
            raise ModelSourceError(f"{name} is not a file of the model folder the service uses")
        return _PROC_FD / str(self._fds[name]) if _PROC_FD.is_dir() else self._reals[name]

    def open(self, name: str) -> BinaryIO:
        """A reader of its own (its own offset) of the checked file."""
        return self.path(name).open("rb")

    def read(self, name: str) -> bytes:
        with self.open(name) as handle:
            return handle.read()

    def read_json(self, name: str) -> Any:
        """A side file's JSON (at most :data:`MAX_SIDE_JSON_BYTES`), read through its descriptor."""
        if self._identity[name].size > MAX_SIDE_JSON_BYTES:
            raise ModelSourceError(f"{name} is larger than {MAX_SIDE_JSON_BYTES >> 20} MiB, which is refused")
        try:
            return json.loads(self.read(name))
        except RecursionError:
            raise ModelSourceError(f"{name} is JSON nested too deeply to parse") from None
        except ValueError as exc:
            raise ModelSourceError(f"{name} is not valid JSON: {exc}") from None

    def identity(self) -> dict[str, FileIdentity]:
        """Each file's identity as it was when opened."""
        return dict(self._identity)

    def check_unchanged(self, name: str | None = None) -> None:
        """Refuse ``name`` (every file, when ``None``) if it was written since it was opened
        (``fstat``: a write in place sets a new ctime). A model loaded on the CPU maps its shards:
        such a write changes the weights a job is using, so a reader checks after each read, and a
        job before it publishes.

        Raises:
            ModelFilesChanged: naming the file.
        """
        for each in self._fds if name is None else [name]:
            now = FileIdentity.of(os.fstat(self._fds[each]))
            if now != self._identity[each]:
                raise ModelFilesChanged(
                    f"{each} was written while it was being read ({self._identity[each].differences(now)}); "
                    "re-register the model once its files no longer change"
                )

    def check(self, registered: Mapping[str, FileIdentity]) -> None:
        """Refuse files that are not the registered ones (checked by ``fstat`` of the opened
        descriptors, now: a file rewritten in place since it was opened counts as changed).

        Raises:
            ModelFilesChanged: naming the first such file and what changed.
        """
        now = {name: FileIdentity.of(os.fstat(fd)) for name, fd in self._fds.items()}
        for name in sorted(set(registered) | set(now)):
            if name not in now:
                raise ModelFilesChanged(f"{name} was removed from the model folder since registration")
            if name not in registered:
                raise ModelFilesChanged(f"{name} was added to the model folder since registration")
            if now[name] != registered[name]:
                raise ModelFilesChanged(f"{name} is not the file registered ({registered[name].differences(now[name])})")


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def open_model_files(folder: Path) -> ModelFiles:
    """Open every file the service uses from ``folder`` once, checked (see :class:`ModelFiles`).

    Each file is found by the folder's rules (:func:`~service.engine.model_files.used_files`, the
    symlink policy), then opened by its resolved path one component at a time with ``O_NOFOLLOW``
    (a link put into that path since is refused, not followed), never blocking (a FIFO swapped in
    cannot hang the job), and must be a regular file by ``fstat``. The index's shard list is read
    again through its descriptor and must name the shards opened: a folder rewritten while it is
    opened is refused.

    Raises:
        ModelSourceError: a rule is broken; the message names the file.
    """
    dirs = allowed_dirs(folder)
    shards = weight_files(folder, dirs)
    wanted = side_files(folder, dirs)
    wanted.update({name: resolve_file(folder, name, dirs) for name in shards})
    fds: dict[str, int] = {}
    try:
        for name, real in sorted(wanted.items()):
            fds[name] = open_without_links(real, name)
        files = ModelFiles(folder, fds, wanted, shards)
    except BaseException:
        _close_all(list(fds.values()))
        raise
    if files.has(INDEX_FILE):
        mapping = files.read_json(INDEX_FILE).get("weight_map")
        if not isinstance(mapping, dict) or sorted(set(mapping.values())) != shards:
            files.close()
            raise ModelSourceError(f"{INDEX_FILE} changed while the model folder was opened; try again")
    return files


def open_without_links(real: Path, name: str) -> int:
    """A read-only descriptor of the regular file at the absolute, resolved path ``real``, opened one
    component at a time relative to its parent's descriptor with ``O_NOFOLLOW``.

    Raises:
        ModelSourceError: a component is (now) a link or not a directory, the file is missing, or
            is not a regular file; the message names ``name``.
    """
    dir_flags = os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_PATH", os.O_RDONLY)
    parent = os.open(real.anchor or "/", dir_flags)
    try:
        for part in real.parts[1:-1]:
            child = os.open(part, dir_flags, dir_fd=parent)
            os.close(parent)
            parent = child
        fd = os.open(real.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ModelSourceError(f"{name} was replaced by a symbolic link, or a link was put in its path") from None
        if exc.errno == errno.ENOENT:
            raise ModelSourceError(f"{name} does not exist in the model folder") from None
        raise ModelSourceError(f"{name} cannot be opened: {exc.strerror}") from None
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelSourceError(f"{name} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def as_model_files(source: Path | ModelFiles) -> ModelFiles:
    """``source`` itself, or a folder's files opened now (:func:`open_model_files`): what every reader
    of model weights takes, so a job's checked files and a test's folder are read the same way."""
    return source if isinstance(source, ModelFiles) else open_model_files(source)


@contextmanager
def model_files_of(source: Path | ModelFiles) -> Iterator[ModelFiles]:
    """:func:`as_model_files` for one block: files opened here are closed at its end, a caller's are not."""
    files = as_model_files(source)
    try:
        yield files
    finally:
        if files is not source:
            files.close()


@contextmanager
def clean_view(files: ModelFiles) -> Iterator[Path]:
    """A private directory with a link to each of the opened :class:`ModelFiles` (their descriptors'
    ``/proc/self/fd`` paths) and nothing else, for transformers' ``from_pretrained``: it would read
    any other file it knows of, and it reads these by name."""
    with tempfile.TemporaryDirectory(prefix="engram-model-view-") as tmp:
        view = Path(tmp)
        for name in files.names:
            (view / name).symlink_to(files.path(name))
        yield view
