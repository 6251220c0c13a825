"""Models kept loaded between jobs: a worker (or the embedded job process) reuses its last model."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from service.engine.checkpoint import load_model, load_tokenizer
from service.local_copies import checked_model_dir
from service.registry import Context


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
