"""Which files of a model folder the service reads, and the rules each of them must pass.

A model folder is untrusted input: whoever can write into a model root, an S3 prefix or a hub
repository decides its names, its links and its index. So the service never lists a folder and
uses what it finds; it opens only

- the **side files** named in :data:`SIDE_FILES` (config, generation config, tokenizer files, the
  index), when present, and
- the **shards**: ``model.safetensors``, or the file names in ``model.safetensors.index.json``'s
  ``weight_map``, each a plain file name (no ``/`` or ``\\``, not ``.`` or ``..``, no NUL, ending in
  ``.safetensors``; :func:`check_shard_name`).

**Symlink policy.** A link is followed only when the file it finally resolves to is a *regular
file inside the model folder* or, for a Hugging Face hub cache snapshot
(``…/models--org--name/snapshots/<revision>/``), inside that cache repo's own ``blobs/``
directory, where the hub keeps the content its snapshot links point to (:func:`allowed_dirs`).
Every other link is refused with :class:`ModelSourceError` naming the file: at registration every
top-level entry of the folder is checked (:func:`check_links`), even ones the service would never
read, and at use each file is resolved again (:func:`resolve_file`), so a link swapped in after
registration is refused before anything is read or copied.

**Opened once, read through the descriptor.** Registration and every job open each used file once
(:func:`open_model_files`): its resolved path one component at a time with ``O_NOFOLLOW``, a
regular file by ``fstat``. The identity of each (:class:`FileIdentity`: size, mtime, inode, ctime)
is recorded at registration from those descriptors and compared by every job; the bytes are then
read only through the descriptors (:class:`ModelFiles`), so a file swapped between the check and
the read is never the one read.

transformers reads more of a folder than the service asks for (``adapter_config.json``,
``additional_chat_templates/``, …): :func:`clean_view` gives it a private directory holding links
to the checked files and nothing else; the one file name it takes from a file's content
(``tokenizer_config.json``'s ``fast_tokenizer_files``) must be plain (:func:`check_tokenizer_config`).
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

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

# Everything besides the shards that the service reads from a model folder, and so everything a
# checkpoint variant copies from it: nothing else (no README, no stray side file) ever is.
SIDE_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    INDEX_FILE,
    # tokenizer
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)

# The JSON side files are parsed whole in memory, some in the API process itself: one of gigabytes
# would take it down. The largest real ones (a 671B model's index, a tokenizer_config.json with
# every added token) are under 10 MB.
MAX_SIDE_JSON_BYTES = 64 << 20

_HUB_REPO_PREFIXES = ("models--",)


class ModelSourceError(ValueError):
    """A model directory we refuse to use; the message says why."""


def is_plain_name(name: object) -> bool:
    """A single path component: a non-empty string with no separator, NUL, ``.`` or ``..``."""
    return isinstance(name, str) and name not in {"", ".", ".."} and not any(c in name for c in ("/", "\\", "\x00"))


def check_shard_name(name: object) -> str:
    """``name`` if it is a plain ``*.safetensors`` file name, else :class:`ModelSourceError` naming it."""
    if not is_plain_name(name) or not str(name).endswith(WEIGHTS_SUFFIX):
        raise ModelSourceError(
            f"{INDEX_FILE} names the shard {name!r}, which is not a plain *.safetensors file name in the model folder"
        )
    return str(name)


def allowed_dirs(folder: Path) -> tuple[Path, ...]:
    """Where the files of ``folder`` may really lie: the folder itself (resolved) and, when it is a
    hub cache snapshot (``<repo>/snapshots/<revision>``, ``<repo>`` named ``models--…``), that
    repo's ``blobs/``. The blobs path is taken lexically: a ``blobs`` that is itself a link to
    elsewhere matches no resolved file, so nothing behind it is accepted."""
    real = folder.resolve()
    dirs = [real]
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith(_HUB_REPO_PREFIXES):
        dirs.append(repo / "blobs")
    return tuple(dirs)


def _inside(path: Path, dirs: tuple[Path, ...]) -> bool:
    return any(d in path.parents for d in dirs)


def resolve_file(folder: Path, name: str, dirs: tuple[Path, ...] | None = None) -> Path:
    """The real path of ``folder/name``, checked to be a regular file in the folder (see the module's
    symlink policy).

    Raises:
        ModelSourceError: ``name`` is not a plain file name, the file is missing, is not a regular
            file, or resolves outside the folder. The message names the file.
    """
    if not is_plain_name(name):
        raise ModelSourceError(f"{name!r} is not a plain file name")
    dirs = allowed_dirs(folder) if dirs is None else dirs
    try:
        real = (folder / name).resolve(strict=True)
    except FileNotFoundError:
        raise ModelSourceError(f"{name} does not exist in the model folder") from None
    except (OSError, RuntimeError) as exc:  # a link loop, a permission error
        raise ModelSourceError(f"{name} cannot be resolved: {exc.__class__.__name__}") from None
    if not _inside(real, dirs):
        raise ModelSourceError(f"{name} is a symbolic link leading out of the model folder, which is refused")
    if not stat.S_ISREG(real.stat().st_mode):
        raise ModelSourceError(f"{name} is not a regular file")
    return real


def check_links(folder: Path) -> None:
    """Refuse a folder with any top-level entry that is a link leading out of it (see the policy),
    whether or not the service would read it: a link out is never an accident worth serving.

    Raises:
        ModelSourceError: naming the first such entry.
    """
    dirs = allowed_dirs(folder)
    for entry in sorted(folder.iterdir()):
        if not entry.is_symlink():
            continue
        try:
            real = entry.resolve()
        except (OSError, RuntimeError):
            raise ModelSourceError(f"{entry.name} is a symbolic link that cannot be resolved") from None
        if not _inside(real, dirs):
            raise ModelSourceError(f"{entry.name} is a symbolic link leading out of the model folder, which is refused")


def present(folder: Path, name: str) -> bool:
    """Whether ``folder`` has an entry ``name`` (a dangling link counts: using it is an error)."""
    return os.path.lexists(folder / name)


def read_side_json(folder: Path, name: str, dirs: tuple[Path, ...] | None = None) -> Any:
    """A side file's JSON, after the folder's rules (:func:`resolve_file`); anything unreadable is a
    :class:`ModelSourceError` naming the file: one over :data:`MAX_SIDE_JSON_BYTES` (refused before
    it is read) or nested deeper than Python's parser goes (a ``RecursionError``, not a ``ValueError``)."""
    try:
        with open_file(resolve_file(folder, name, dirs)) as handle:
            if os.fstat(handle.fileno()).st_size > MAX_SIDE_JSON_BYTES:
                raise ModelSourceError(f"{name} is larger than {MAX_SIDE_JSON_BYTES >> 20} MiB, which is refused")
            return json.loads(handle.read())
    except ModelSourceError:
        raise
    except RecursionError:
        raise ModelSourceError(f"{name} is JSON nested too deeply to parse") from None
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{name} is not valid JSON: {exc}") from None


def read_bytes(path: Path) -> bytes:
    with open_file(path) as handle:
        data: bytes = handle.read()
        return data


def open_file(path: Path) -> Any:
    """A binary reader of a resolved regular file (``O_NOFOLLOW``: a link put in its place is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ModelSourceError(f"{path.name} was replaced by a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelSourceError(f"{path.name} is not a regular file")
    return os.fdopen(fd, "rb")


def weight_map(folder: Path, dirs: tuple[Path, ...] | None = None) -> dict[str, str]:
    """The index's ``weight_map`` (tensor key -> shard), every shard name checked, or ``{}`` without an index.

    Raises:
        ModelSourceError: an unreadable index, a shard that is not a plain ``*.safetensors`` name
            of a regular file in the folder (the message names it; that file is never opened), or
            an index without the ``metadata`` object transformers needs.
    """
    if not present(folder, INDEX_FILE):
        return {}
    index = read_side_json(folder, INDEX_FILE, dirs)
    mapping = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(k, str) for k in mapping):
        raise ModelSourceError(f"{INDEX_FILE} has no weight_map object")
    for shard in sorted({check_shard_name(v) for v in mapping.values()}):
        try:
            resolve_file(folder, shard, dirs)
        except ModelSourceError as exc:
            raise ModelSourceError(f"{INDEX_FILE} names the shard {shard!r}: {exc}") from None
    if not isinstance(index.get("metadata"), dict):  # after the shards: a bad name is the worse news
        # transformers reads index["metadata"] unconditionally: without it no job could load the model
        raise ModelSourceError(f"{INDEX_FILE} has no metadata object, which transformers needs to load the checkpoint")
    return dict(mapping)


def weight_files(folder: Path, dirs: tuple[Path, ...] | None = None) -> list[str]:
    """The checked shard names of a model folder: the index's, else ``model.safetensors``, else none."""
    mapping = weight_map(folder, dirs)
    if mapping:
        return sorted(set(mapping.values()))
    if present(folder, INDEX_FILE):
        return []  # an index without shards: no weights
    if present(folder, WEIGHTS_FILE):
        resolve_file(folder, WEIGHTS_FILE, dirs)
        return [WEIGHTS_FILE]
    return []


def side_files(folder: Path, dirs: tuple[Path, ...] | None = None) -> dict[str, Path]:
    """Name -> resolved path of the :data:`SIDE_FILES` present in ``folder``, each checked."""
    dirs = allowed_dirs(folder) if dirs is None else dirs
    return {name: resolve_file(folder, name, dirs) for name in SIDE_FILES if present(folder, name)}


def check_tokenizer_config(folder: Path, files: ModelFiles | None = None) -> None:
    """Refuse a ``tokenizer_config.json`` whose ``fast_tokenizer_files`` are not plain file names:
    transformers joins them to the folder and opens them (an absolute name would open any file).
    ``files``: read it through these opened files rather than by name.

    Raises:
        ModelSourceError: naming the file.
    """
    name = "tokenizer_config.json"
    if not (files.has(name) if files is not None else present(folder, name)):
        return
    config = files.read_json(name) if files is not None else read_side_json(folder, name)
    names = config.get("fast_tokenizer_files") if isinstance(config, dict) else None
    if names is not None and (not isinstance(names, list) or not all(is_plain_name(n) for n in names)):
        raise ModelSourceError("tokenizer_config.json lists fast_tokenizer_files that are not plain file names")


def used_files(folder: Path) -> dict[str, Path]:
    """Name -> resolved path of every file the service reads from ``folder``: side files and shards,
    sorted by name, each checked (see the module's rules).

    Raises:
        ModelSourceError: naming the first file that breaks a rule.
    """
    dirs = allowed_dirs(folder)
    files = side_files(folder, dirs)
    files.update({name: resolve_file(folder, name, dirs) for name in weight_files(folder, dirs)})
    return dict(sorted(files.items()))


def target_file(directory: Path, name: str) -> Path:
    """``directory/name`` for a writer, refused (``ValueError``) unless it stays in ``directory``:
    ``name`` must be a plain file name and the path must not already be a link."""
    if not is_plain_name(name):
        raise ValueError(f"refusing to write {name!r}: not a plain file name")
    path = directory / name
    if path.is_symlink() or path.resolve().parent != directory.resolve():
        raise ValueError(f"refusing to write {name!r}: it would leave {directory}")
    return path


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


# ---------------------------------------------------------------- files opened once, checked through their descriptors
#
# Checking a path and then reading it by name leaves a window in which the name can be pointed at
# another file (a link swapped in, a rename over it). A job therefore opens every file it uses once
# (:func:`open_model_files`), checks what it opened (a regular file, reached through no link, the
# identity recorded at registration), and reads only through those descriptors: transformers and
# safetensors get ``/proc/self/fd/<n>`` paths, which reopen the very file that was checked.

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
    """The files the service uses from one model folder (:func:`used_files`), each opened once.

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

    Each file is found by the folder's rules (:func:`used_files`, the symlink policy), then opened by
    its resolved path one component at a time with ``O_NOFOLLOW`` (a link put into that path since
    is refused, not followed), never blocking (a FIFO swapped in cannot hang the job), and must be
    a regular file by ``fstat``. The index's shard list is read again through its descriptor and
    must name the shards opened: a folder rewritten while it is opened is refused.

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
