"""A published statistics' manifest and header, and their publication.

The collection job writes the statistics file, then the manifest (:func:`publish_statistics`): the
statistics exist exactly when the manifest does, and never change after (content-addressed), so
readers cache both for the life of the process: the manifest through ``ctx.reads``, the header in
:data:`HEADERS`, keyed by store and prefix (one process may hold several stores: tests do).
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


class PublishedHeaders:
    """The headers of published statistics, each read once per process and store: statistics never
    change, so nothing here goes stale."""

    def __init__(self) -> None:
        self._headers: dict[tuple[str, str], StatsHeader] = {}

    def __contains__(self, where: tuple[Storage, str]) -> bool:
        storage, prefix = where
        return (storage.location, prefix) in self._headers

    def of(self, storage: Storage, prefix: str) -> StatsHeader:
        key = (storage.location, prefix)
        if key not in self._headers:
            self._headers[key] = StatsHeader.read(storage, prefix)
        return self._headers[key]


HEADERS = PublishedHeaders()
