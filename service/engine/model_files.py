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

**Opened once, read through the descriptor.** Registration and every job then open each used
file once and read it only through that descriptor: :mod:`service.engine.model_file_descriptors`.

transformers reads more of a folder than the service asks for (``adapter_config.json``,
``additional_chat_templates/``, …); the one file name it takes from a file's content
(``tokenizer_config.json``'s ``fast_tokenizer_files``) must be plain (:func:`check_tokenizer_config`).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Protocol

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


class OpenedFiles(Protocol):
    """Side files read through descriptors opened once
    (:class:`~service.engine.model_file_descriptors.ModelFiles`)."""

    def has(self, name: str) -> bool: ...

    def read_json(self, name: str) -> Any: ...


def check_tokenizer_config(folder: Path, files: OpenedFiles | None = None) -> None:
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
