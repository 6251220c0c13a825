"""The ``register`` job's side of a GGUF model: the file hashed, checked and dequantized once into a
checkpoint folder (:func:`service.engine.gguf_read.dequantize_gguf`).

The folder is ``ENGRAM_CACHE_DIR/gguf/<sha256>-<recipe>``: keyed by the file's content and by the
versions of the code that reads it (:data:`RECIPE`, transformers and gguf), so the same file
registered under two IDs, or again after a restart, is dequantized once, and a new loader is a new
folder, never a stale one. It is built in a temporary folder beside it and renamed into place: a
job never sees half of one. Dequantizing loads the whole model (float32) in the job's process; the
API only checks the source's form (:mod:`service.models.gguf_source`).

Only a job process imports this module (through :mod:`service.models.inspection`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from service.engine.gguf_read import check_gguf_readable, dequantize_gguf, read_gguf_header
from service.engine.model_file_descriptors import FileIdentity, open_without_links
from service.engine.model_files import ModelSourceError
from service.errors import InvalidInput
from service.models.gguf_source import GgufOrigin

RECIPE = "1"  # the folder's layout: float32 safetensors, config without quantization_config, the file's tokenizer


def _hash_file(path: Path) -> tuple[str, FileIdentity]:
    """The SHA-256 of the file at ``path`` and its identity, both through one descriptor opened
    without following links."""
    fd = open_without_links(path, path.name)
    try:
        before = FileIdentity.of(os.fstat(fd))
        digest = hashlib.sha256()
        while block := os.read(fd, 1 << 20):
            digest.update(block)
        if FileIdentity.of(os.fstat(fd)) != before:
            raise ModelSourceError(f"{path.name} changed while it was read: register it once it is written")
        return digest.hexdigest(), before
    finally:
        os.close(fd)


def _folder_name(sha256: str) -> str:
    versions = "-".join(metadata.version(name) for name in ("transformers", "gguf"))
    tag = hashlib.sha256(f"{RECIPE}/{versions}".encode()).hexdigest()[:12]
    return f"{sha256}-{tag}"


def gguf_checkpoint(cache_dir: Path, path: Path) -> tuple[Path, GgufOrigin]:
    """The checkpoint folder of the GGUF file at ``path`` (dequantized now unless this machine
    already did) and the record of the file.

    Raises:
        InvalidInput: the file is not a GGUF transformers' loader reads (its architecture, a tensor
            type, a broken file: named), or it changed while it was read.
    """
    try:
        sha256, identity = _hash_file(path)
        header = read_gguf_header(path)
        check_gguf_readable(header, path.name)
        root = cache_dir / "gguf"
        target = root / _folder_name(sha256)
        if not target.is_dir():
            _build(path, root, target)
        if _hash_file(path)[1] != identity:  # the loader read it by name: the same file it hashed?
            raise ModelSourceError(f"{path.name} changed while it was read: register it once it is written")
    except ModelSourceError as exc:
        raise InvalidInput(str(exc)) from None
    origin = GgufOrigin(
        file=str(path),
        sha256=sha256,
        identity=identity.to_json(),
        quantization=header.quantization,
        architecture=header.architecture,
    )
    return target, origin


def registered_gguf_folder(cache_dir: Path, path: Path, origin: GgufOrigin) -> Path:
    """This machine's checkpoint folder of a registered GGUF model, whose file is at ``path`` here:
    the one built already, else dequantized now (a worker other than the one that registered it).

    Raises:
        ModelSourceError: the file at ``path`` is not the registered content, or cannot be read.
    """
    target = cache_dir / "gguf" / _folder_name(origin.sha256)
    if target.is_dir():
        return target
    try:
        folder, found = gguf_checkpoint(cache_dir, path)
    except InvalidInput as exc:
        raise ModelSourceError(str(exc)) from None
    if found.sha256 != origin.sha256:
        raise ModelSourceError(f"{path.name} has other content than the GGUF file registered")
    return folder


def _build(path: Path, root: Path, target: Path) -> None:
    """Dequantize ``path`` into a fresh folder beside ``target`` and rename it to ``target``."""
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        dequantize_gguf(path, partial)
        partial.chmod(0o755)
        try:
            os.rename(partial, target)
        except OSError:
            if not target.is_dir():  # not a concurrent registration of the same file that finished first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
