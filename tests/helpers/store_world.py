"""An in-process service for the universe, engram and variant tests: real file storage, real job
records and the real job bodies, with jobs run when the test says so (``run_pending``).

Concepts are published as a collection job would publish them (statistics file, its manifest, the
concept record), from statistics collected here by ``collect_statistics``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engram_fixtures.demo import make_facts
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from engram_fixtures.statistics import publish_concept_statistics
from service.config import Settings
from service.context import Context
from service.engine.checkpoint import load_model, load_tokenizer
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.layout import ModelLayout
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from service.execution.runner import run_job
from service.jobs.records import JobRecord
from service.jobs.store import JobStore
from service.models.inspection import register_model
from service.storage.base import Storage
from service.storage.local import LocalStorage

MAX_LENGTH = 120


def text_records(start: int, stop: int, seed: int = 11) -> list[Record]:
    return [Record(text=p + c) for p, c in make_facts(200, seed=seed)[start:stop]]


def float64_copy(source: Path, target: Path, dtype: torch.dtype = torch.float64) -> Path:
    """The same checkpoint with every floating tensor stored as ``dtype`` (float64 by default)."""
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.suffix == ".safetensors":
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(file)).items()}
            save_file(tensors, str(target / file.name), metadata={"format": "pt"})
        else:
            (target / file.name).write_bytes(file.read_bytes())
    return target


class StoreWorld:
    """One storage, its job store, registered models and published concepts."""

    def __init__(self, root: Path, storage: Storage | None = None) -> None:
        """Args:
        storage: the store (default: file storage under ``root / "store"``; an S3 store for the
            tests of what S3 does differently)."""
        self.root = root
        (root / "models").mkdir(parents=True, exist_ok=True)
        settings = Settings(
            storage_url=f"file://{root / 'store'}", model_roots=str(root / "models"), cache_dir=root / "cache"
        )
        storage = storage or LocalStorage(root / "store")
        self.pending: list[JobRecord] = []
        self.ctx = Context(
            settings=settings, storage=storage, jobs=JobStore(storage), dispatch=self.pending.append, lock=threading.RLock()
        )
        self._models: dict[str, tuple[Any, Any, ModelLayout]] = {}

    def tiny_llama(self, model_id: str, concepts: dict[str, Sequence[Record]], *, hidden: int = 32, seed: int = 0) -> Path:
        """A random tiny Llama (2 layers, :func:`make_tiny_llama`) registered as ``model_id``, with each
        concept (name -> records) published on it; its folder."""
        path = make_tiny_llama(
            self.root / "models" / model_id.replace("/", "-"), hidden=hidden, layers=2, seed=seed, tokenizer=make_tokenizer()
        )
        self.register(model_id, path)
        for name, records in concepts.items():
            self.publish(model_id, name, records)
        return path

    def register(self, model_id: str, path: Path) -> dict[str, Any]:
        manifest, _ = register_model(self.ctx, model_id, f"file://{path}")
        return manifest

    def collect(self, model_id: str, records: Sequence[Record]) -> LayerStatistics:
        model, tokenizer, layout = self._loaded(model_id)
        examples = [encode_record(tokenizer, r, MAX_LENGTH) for r in records]
        return collect_statistics(model, make_batches(examples, 16, pad_token_id(tokenizer)), layout.layers)

    def publish(self, model_id: str, name: str, records: Sequence[Record], role: str = "target") -> LayerStatistics:
        """Collect and publish concept ``name`` on ``model_id`` as a collection job would."""
        stats = self.collect(model_id, records)
        digest = hashlib.sha256("\n".join(repr(r) for r in records).encode()).hexdigest()
        publish_concept_statistics(
            self.ctx, model_id, name, stats, num_records=len(records), dataset_digest=digest, scratch=self.root, role=role
        )
        return stats

    def run_pending(self) -> list[JobRecord]:
        """Run every dispatched job to its end; returns their final records."""
        done = []
        while self.pending:
            job = self.pending.pop(0)
            run_job(self.ctx, job.job_id)
            found = self.ctx.jobs.get(job.job_id)
            assert found is not None
            done.append(found)
        return done

    def _loaded(self, model_id: str) -> tuple[Any, Any, ModelLayout]:
        if model_id not in self._models:
            manifest = self.ctx.storage.get_json(f"models/{model_id.replace('/', '%2F')}.json")
            path = Path(manifest["path"])
            layout = ModelLayout.from_json(manifest["layout"])
            self._models[model_id] = (load_model(path, dtype=torch.float32), load_tokenizer(path), layout)
        return self._models[model_id]
