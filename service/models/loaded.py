"""A model on this machine: its checked files, and the models a worker keeps loaded between jobs.

A job reads a model only through :func:`checked_model_files`: every file the service uses is opened
once and checked through its descriptor (no link in its path, a regular file, the identity
recorded at registration), then read only through that descriptor. A worker (or the embedded job
process) reuses its last loaded model (:data:`MODELS`), after the same check.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from service.context import Context
from service.engine.checkpoint import directory_digest, files_digest, load_model, load_tokenizer
from service.engine.model_files import FileIdentity, ModelFiles, ModelSourceError, check_links, open_model_files
from service.errors import JobFailed
from service.models.registry import find_model, registered_identity
from service.models.sources import local_model_dir
from service.storage.keys import model_key

REREGISTER = "re-register the model"


def checked_model_files(ctx: Context, manifest: dict[str, Any]) -> ModelFiles:
    """The files of a registered model on this machine, opened and checked (:mod:`service.engine.model_files`).

    A ``file://`` model is read in place: each file must have the identity (size, mtime, inode, ctime)
    recorded at registration. A remote one (``s3://``, ``hf://``) is read from this machine's
    private copy, which need not be the registering machine's: its content digest is checked once
    per copy, and the identity it had then is what later jobs compare (:func:`_check_private_copy`).
    No job hashes a checkpoint whose identity is known.

    Raises:
        JobFailed: a file is not the registered one, or breaks a rule of the model folder; the
            message names the file and says to re-register the model.
    """
    model_id = manifest["model_id"]
    try:
        if manifest["source"].startswith("file://"):
            return _checked_in_place(ctx, manifest)
        path = local_model_dir(manifest["source"], [], ctx.cache_dir, ctx.settings.s3_endpoint_url)
        check_links(path)  # local_model_dir checked it too; a link out is refused even where unused
        files = open_model_files(path)
        try:
            _check_private_copy(ctx, manifest, files)
        except BaseException:
            files.close()
            raise
        return files
    except ModelSourceError as exc:
        raise JobFailed(f"the files of model {model_id} changed since registration: {exc}; {REREGISTER}") from None


def _checked_in_place(ctx: Context, manifest: dict[str, Any]) -> ModelFiles:
    """A ``file://`` model's files, opened in its registered folder and checked against the identity
    recorded at registration (recorded now, after its digest is checked, for an older registration)."""
    path = Path(manifest["path"])
    if not path.is_dir():
        raise ModelSourceError(f"the model folder {path} is gone")
    if path.resolve() != path:  # registered resolved: the folder, or a folder above it, became a link
        raise ModelSourceError("the model folder was replaced by a symbolic link")
    check_links(path)  # a link leading out is refused even where no used file is one (registration did)
    files = open_model_files(path)
    try:
        registered = registered_identity(manifest)
        if registered is None:
            _record_identity(ctx, manifest, files)
        else:
            files.check(registered)
    except BaseException:
        files.close()
        raise
    return files


def _record_identity(ctx: Context, manifest: dict[str, Any], files: ModelFiles) -> None:
    """Give a registration made before identities were recorded the identity of its files, once:
    only after their content, read through the same descriptors, proves to be the registered digest.

    Lazily, not by refusal: a model cannot be registered again under its ID (the same source is the
    same registration), so refusing would end every such model for good; one hash per model, ever,
    is the price, and the check after it is the one every newer registration gets.

    Raises:
        ModelSourceError: the content is not the registered content.
    """
    _check_digest(manifest, files)
    identity = {name: value.to_json() for name, value in files.identity().items()}
    with ctx.lock:
        current = find_model(ctx, manifest["model_id"])
        if current is not None and current["digest"] == manifest["digest"] and "identity" not in current:
            ctx.storage.put_json(model_key(manifest["model_id"]), {**current, "identity": identity})
    manifest["identity"] = identity


def _check_digest(manifest: dict[str, Any], files: ModelFiles) -> None:
    """Raise unless ``files`` hold the registered content (registrations made before the allowlist
    hashed every in-folder file: their digest is recognised too)."""
    digest = manifest["digest"]
    if files_digest(files) != digest and directory_digest(files.folder, every_file=True) != digest:
        raise ModelSourceError("their content is not the registered content (its digest differs)")


def _check_private_copy(ctx: Context, manifest: dict[str, Any], files: ModelFiles) -> None:
    """Check this machine's copy of a remote model: against the identity it had when its digest was
    last checked on this machine (kept beside the cache, :func:`copy_record`), else by its digest,
    once, recording its identity for the jobs that follow.

    The registered identity does not apply: each machine downloads its own copy (other inodes and
    mtimes). The copy lies in ``ENGRAM_CACHE_DIR``, written only by the service.
    """
    record = copy_record(ctx, files.folder)
    saved = _read_record(record)
    if saved is not None and saved.get("digest") == manifest["digest"]:
        identity = {name: FileIdentity.from_json(value) for name, value in saved.get("identity", {}).items()}
        if all(value is not None for value in identity.values()):
            files.check({name: value for name, value in identity.items() if value is not None})
            return
    _check_digest(manifest, files)
    write_copy_record(ctx, files, manifest["digest"])


def copy_record(ctx: Context, folder: Path) -> Path:
    """Where the identity of a verified private copy of a remote model is kept: beside the cache."""
    return ctx.cache_dir / "verified-models" / f"{hashlib.sha256(str(folder).encode()).hexdigest()[:40]}.json"


def write_copy_record(ctx: Context, files: ModelFiles, digest: str) -> None:
    """Record that ``files`` (a private copy) hold ``digest``, with their identity, atomically."""
    record = copy_record(ctx, files.folder)
    record.parent.mkdir(parents=True, exist_ok=True)
    identity = {name: value.to_json() for name, value in files.identity().items()}
    partial = record.with_name(f".{record.name}.{os.getpid()}.{threading.get_ident()}")
    partial.write_text(json.dumps({"folder": str(files.folder), "digest": digest, "identity": identity}))
    os.replace(partial, record)


def _read_record(record: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class ModelCache:
    """A small LRU of loaded models keyed by checkpoint digest (a worker reuses its model)."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, ctx: Context, manifest: dict[str, Any], device: str, dtype: str | None = None, device_map: str | None = None
    ) -> tuple[Any, Any]:
        """The model (in ``dtype``, default: as stored; on ``device``, or placed by accelerate's
        ``device_map``) and its tokenizer, loaded on first use."""
        placement = f"map:{device_map}" if device_map else device
        key = f"{manifest['digest']}@{placement}/{dtype or 'stored'}"
        # Checked at every job, loaded or not: a job on changed files fails, as one loading them would.
        with checked_model_files(ctx, manifest) as files, self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            torch_dtype = getattr(torch, dtype) if dtype else None
            model = load_model(files, device=device, dtype=torch_dtype, device_map=device_map)
            item = (model, load_tokenizer(files))
            self._items[key] = item
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
            return item


MODELS = ModelCache()  # one per process: a worker keeps its last models loaded between jobs
