"""A published statistics' manifest and header, and their publication.

The collection job writes the statistics file, then the manifest (:func:`publish_statistics`): the
statistics exist exactly when the manifest does, and never change after (content-addressed), so
readers cache both for the life of the process: the manifest through ``ctx.reads``, the header in
the Context's ``caches.stats_headers``, keyed by store and prefix (one process may hold several
stores: tests do).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.context import Context
from service.statistics.key import manifest_key, statistics_key
from service.storage.base import Storage


def stats_manifest(ctx: Context, prefix: str) -> dict[str, Any] | None:
    """The manifest of the statistics at ``prefix``; ``None`` while they are not published."""
    return ctx.reads.immutable_json(manifest_key(prefix))  # content-addressed: written once


def publish_statistics(ctx: Context, prefix: str, file: Path, manifest: Callable[[], dict[str, Any]]) -> None:
    """Store the statistics file, then its manifest (last: the statistics exist exactly when it does),
    built once the file is stored (so its ``created_at`` says when they were published)."""
    ctx.storage.put_file(statistics_key(prefix), file)
    ctx.storage.put_json(manifest_key(prefix), manifest())


@dataclass(frozen=True)
class StatsHeader:
    """What a statistics file's header says (:mod:`service.engine.stats_io` writes it)."""

    layer_group: dict[str, str]  # layer -> its input group
    dims: dict[str, int]  # input group -> its width
    counts: dict[str, int]  # input group -> the tokens counted
    unreached: frozenset[str]  # layers no forward pass ran

    @classmethod
    def read(cls, storage: Storage, prefix: str) -> StatsHeader:
        """The header of the statistics file at ``prefix``, read by range: a few kilobytes of a file
        of gigabytes."""
        key = statistics_key(prefix)
        length = int.from_bytes(b"".join(storage.iter_range(key, 0, 7)), "little")
        meta = json.loads(b"".join(storage.iter_range(key, 8, 8 + length - 1))).get("__metadata__") or {}
        return cls(
            json.loads(meta.get("layer_group", "{}")),
            json.loads(meta.get("dims", "{}")),
            json.loads(meta.get("counts", "{}")),
            frozenset(json.loads(meta.get("unreached", "[]"))),
        )


def stats_header(ctx: Context, prefix: str) -> StatsHeader:
    """The header of published statistics, read once per process and store (the Context's
    ``caches.stats_headers``): statistics never change, so nothing there goes stale."""
    cached: StatsHeader | None = ctx.caches.stats_headers.get(ctx.storage, prefix)
    return (
        cached
        if cached is not None
        else ctx.caches.stats_headers.put(ctx.storage, prefix, StatsHeader.read(ctx.storage, prefix))
    )


def has_stats_header(ctx: Context, prefix: str) -> bool:
    """Whether this process read the header already (the statistics were published then)."""
    return ctx.caches.stats_headers.get(ctx.storage, prefix) is not None
