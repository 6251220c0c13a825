"""A model on this machine: its checked folder, and the models a worker keeps loaded between jobs.

A job reads a model only through :func:`checked_model_dir`, which checks the folder still holds the
registered files; a worker (or the embedded job process) reuses its last loaded model (:data:`MODELS`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from service.context import Context
from service.engine.checkpoint import directory_digest, load_model, load_tokenizer
from service.engine.model_files import SIDE_FILES, ModelSourceError, check_links
from service.errors import JobFailed
from service.models.registry import file_fingerprint
from service.models.sources import local_model_dir

_VERIFIED: dict[str, str] = {}  # local copy of a remote source -> its verified digest


def checked_model_dir(ctx: Context, manifest: dict[str, Any]) -> Path:
    """This process's directory of the model, after checking it holds the registered files.

    A ``file://`` model is read in place (its sizes and mtimes must be as registered). A remote
    one (``s3://``, ``hf://``) is fetched into this machine's cache, which need not be the API's,
    and its content digest checked once per process.

    Either way the folder passes :mod:`service.engine.model_files`' rules again first (no link
    leading out of it, plain shard names), so a link swapped in since registration fails the job
    before any file is read or copied.
    """
    model_id = manifest["model_id"]
    try:
        if manifest["source"].startswith("file://"):
            path = Path(manifest["path"])
            if not path.is_dir() or not _unchanged(path, manifest):
                raise JobFailed(f"the files of model {model_id} changed since registration; register it again")
            return path
        path = local_model_dir(manifest["source"], [], ctx.cache_dir, ctx.settings.s3_endpoint_url)
        digest = manifest["digest"]
        if _VERIFIED.get(str(path)) != digest:
            check_links(path)
            # Registrations made before the allowlist hashed every in-folder file: accept their digest too.
            if directory_digest(path) != digest and directory_digest(path, every_file=True) != digest:
                raise JobFailed(f"the source of model {model_id} changed since registration; register it again")
            _VERIFIED[str(path)] = digest
        return path
    except ModelSourceError as exc:
        raise JobFailed(f"the files of model {model_id} are refused: {exc}; register it again") from None


def _unchanged(path: Path, manifest: dict[str, Any]) -> bool:
    """Whether the files the service uses from ``path`` are as registered (sizes and mtimes).

    Raises:
        ModelSourceError: the folder breaks a rule of :mod:`service.engine.model_files`.
    """
    if path.resolve() != path:  # registered resolved: the folder, or a folder above it, became a link
        raise ModelSourceError("the model folder was replaced by a symbolic link")
    check_links(path)
    current = file_fingerprint(path)
    return current == _registered_fingerprint(manifest, current)


def _registered_fingerprint(manifest: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The registered sizes and mtimes of the files the service uses. Registrations made before the
    allowlist listed every file of the folder; the others (a README) are not compared."""
    shards = set(manifest["layout"]["key_files"].values())
    return {k: v for k, v in manifest["fingerprint"].items() if k in SIDE_FILES or k in shards or k in current}


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
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            path = checked_model_dir(ctx, manifest)
            torch_dtype = getattr(torch, dtype) if dtype else None
            model = load_model(path, device=device, dtype=torch_dtype, device_map=device_map)
            item = (model, load_tokenizer(path))
            self._items[key] = item
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
            return item


MODELS = ModelCache()  # one per process: a worker keeps its last models loaded between jobs
