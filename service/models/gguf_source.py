"""GGUF models: which sources are a GGUF file, and the file a registration came from.

A source is a GGUF model when it names a ``.gguf`` file, or a folder without ``config.json`` that
holds exactly one ``.gguf`` file (a folder with ``config.json`` is a safetensors checkpoint,
whatever else lies in it): a ``file://`` path inside ``ENGRAM_MODEL_ROOTS``, an ``s3://`` key or
prefix, an ``hf://org/name/<file>.gguf`` or a hub repo holding one (the remote ones downloaded
first, by :mod:`service.models.sources`). The ``register`` job reads the file into a plain
checkpoint folder in ``ENGRAM_CACHE_DIR`` (:mod:`service.models.gguf_convert`), which the
registration's ``path`` names and every job reads as any checkpoint; the registration also records
the GGUF file itself (:class:`GgufOrigin`: its path, SHA-256, identity and quantization type), so a
changed ``.gguf`` makes jobs fail with "re-register the model" and posting the registration again
registers it anew, as a changed safetensors file does.

This module reads no tensor and imports neither torch nor the ``gguf`` package: the API uses it.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from service.engine.model_file_descriptors import FileIdentity
from service.engine.model_files import ModelSourceError
from service.errors import InvalidInput
from service.models.sources import file_uri_path, outside_roots_message

GGUF_SUFFIX = ".gguf"


class GgufOrigin(BaseModel):
    """The GGUF file a registration was read from.

    Attributes:
        file: its resolved path.
        sha256: its content's SHA-256 (hex), part of the registration's identity.
        identity: its (size, mtime, inode, ctime) as hashed, compared by every job.
        quantization: its quantization type (``Q4_1``, ``Q8_0``, ``F16``...).
        architecture: its ``general.architecture`` (``llama``...).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    sha256: str
    identity: list[int]
    quantization: str
    architecture: str


def gguf_file_of(source: str, model_roots: list[Path]) -> Path | None:
    """The GGUF file a ``file://`` source names (checked to lie inside ``model_roots``, links
    resolved), or None when the source is not a GGUF model (another scheme, a checkpoint folder).

    Raises:
        InvalidInput: the file lies outside the roots, or the folder holds several ``.gguf`` files.
    """
    if not source.startswith("file://"):
        return None
    path = Path(file_uri_path(source, "file:// source")).resolve()
    found = gguf_file_in(path)
    if found is None:
        return None
    if not _within(found, model_roots):
        raise InvalidInput(outside_roots_message(found, model_roots))
    return found


def gguf_file_in(path: Path, inside: Path | None = None) -> Path | None:
    """The GGUF file at ``path`` (links resolved): ``path`` itself when it is named ``*.gguf``, or
    the one ``.gguf`` of a folder without ``config.json``; None when ``path`` is not a GGUF model.

    A remote source's download (:func:`service.models.sources.local_model_dir`) is read by the same
    rule, with ``inside`` its cache: a hub file is a link to the repo's ``blobs/``, named by its
    hash, so the suffix is read from the name before the link is resolved.

    Raises:
        InvalidInput: the folder holds several ``.gguf`` files, the file resolves outside
            ``inside``, or it is not a regular file.
    """
    if path.suffix == GGUF_SUFFIX and path.is_file():
        found = path.resolve()
    elif path.is_dir() and not (path / "config.json").exists():
        candidates = sorted(p for p in path.iterdir() if p.suffix == GGUF_SUFFIX)
        if not candidates:
            return None
        if len(candidates) > 1:
            names = ", ".join(p.name for p in candidates)
            raise InvalidInput(f"{path} holds several GGUF files ({names}): register one of them by its own path")
        found = candidates[0].resolve()
    else:
        return None
    if inside is not None and not _within(found, [inside.resolve()]):
        raise InvalidInput(f"{found.name} resolves outside the download directory, which is refused")
    if not found.is_file():
        raise InvalidInput(f"{found} is not a regular file")
    return found


def _within(path: Path, roots: list[Path]) -> bool:
    return any(path.parent == root or root in path.parents for root in roots)


def gguf_change(origin: GgufOrigin) -> str | None:
    """What changed about a registration's GGUF file since it was registered (``None``: nothing),
    by its identity (the file is not read)."""
    registered = FileIdentity.from_json(origin.identity)
    try:
        now = FileIdentity.of(os.stat(origin.file, follow_symlinks=False))
    except OSError as exc:
        return f"{Path(origin.file).name} cannot be read: {exc.strerror}"
    if registered is None or now != registered:
        what = registered.differences(now) if registered is not None else "no identity recorded"
        return f"{Path(origin.file).name} changed since registration ({what})"
    return None


def check_gguf_unchanged(origin: GgufOrigin | None) -> None:
    """Raise when a registration's GGUF file is not the one registered.

    Raises:
        ModelSourceError: naming the file and what changed.
    """
    if origin is None:
        return
    change = gguf_change(origin)
    if change is not None:
        raise ModelSourceError(change)
