"""Publish a concept's statistics, collected by the caller, where a collection job publishes them.

Tests and benches that collect in process (a store world, the mini-CIFAR's class concepts) publish
through this one function: the statistics file under the key the service's collection job would
use, its manifest, and the concept record (a typed :class:`ConceptRecord`, as the service writes it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from service.concepts.record import ConceptModelState, ConceptRecord
from service.concepts.service import find_concept
from service.engine.collect import LayerStatistics
from service.engine.stats_io import save_statistics
from service.jobs.store import utc_now
from service.statistics.manifest import StatisticsManifest, publish_statistics
from service.statistics.spec import CollectionSpec
from service.storage.keys import concept_key, model_key

NO_JOB = "0" * 32  # published by a test or bench, not by a collection job


def publish_concept_statistics(
    ctx: Any,
    model_id: str,
    name: str,
    stats: LayerStatistics,
    *,
    num_records: int,
    dataset_digest: str,
    scratch: Path,
    role: str = "target",
) -> str:
    """Publish ``stats`` as concept ``name``'s collection on ``model_id``; returns the statistics prefix.

    Args:
        dataset_digest: the digest of the records the statistics came from (part of their key).
        scratch: where the statistics file is written before it is put in the store.
    """
    model = ctx.storage.get_json(model_key(model_id))
    prefix: str = CollectionSpec.of(ctx.settings).key(model["digest"], dataset_digest).prefix
    file = scratch / f"{dataset_digest}.safetensors"
    save_statistics(stats, file)
    publish_statistics(ctx, prefix, file, lambda: StatisticsManifest(tokens=stats.tokens))
    concept = find_concept(ctx, name) or ConceptRecord(
        name=name,
        role=role,
        description=None,
        num_records=num_records,
        dataset_digest=dataset_digest,
        models={},
        created_at=utc_now(),
    )
    concept = concept.with_model(model_id, ConceptModelState(job_id=NO_JOB, stats=prefix))
    ctx.storage.put_json(concept_key(name), concept.to_json())
    return prefix


def name_digest(model_id: str, name: str) -> str:
    """A dataset digest for statistics published under a name (no records to hash)."""
    return hashlib.sha256(f"{model_id}/{name}".encode()).hexdigest()
