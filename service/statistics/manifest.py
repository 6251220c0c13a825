"""A published statistics' manifest and header, and their publication.

The collection job writes the statistics file, then the manifest (:func:`publish_statistics`): the
statistics exist exactly when the manifest does, and never change after (content-addressed), so
readers cache both for the life of the process: the manifest through ``ctx.reads``, the header in
the Context's ``caches.stats_headers``, keyed by store and prefix (one process may hold several
stores: tests do).

The manifest is a frozen record (:class:`StatisticsManifest`), read only through
:func:`read_statistics_manifest`; its stored keys are those it always had (no ``format_version``:
content-addressed, written once). The older shapes are read there, in that one reader: ``lacking``
is absent from statistics published before lacking layers were recorded, ``truncation`` from those
published before ``max_length``'s report (None in the record, absent when written back).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import JsonValue, ValidationError

from service.context import Context
from service.errors import ServiceUnavailable, first_validation_error
from service.statistics.key import manifest_key, statistics_key
from service.storage.base import Storage
from service.storage.records import StoredRecord


class StatisticsManifest(StoredRecord):
    """What published statistics hold and how they were collected.

    Only ``tokens`` is in every manifest: statistics published by hand (benchmarks, test worlds)
    record nothing else; a collection job records every field (:mod:`service.concepts.collection`).

    Attributes:
        tokens: the tokens counted.
        groups, layers: the input groups and layers the file holds.
        lacking: hooked layers collection could not read (None: published before they were recorded).
        settings: the collection settings the statistics are keyed by (``CollectionSpec.dump()``).
        truncation: what ``max_length`` did (None: published before it was reported).
    """

    tokens: int
    groups: int | None = None
    layers: int | None = None
    lacking: tuple[str, ...] | None = None
    model_digest: str | None = None
    dataset_digest: str | None = None
    settings: dict[str, JsonValue] | None = None
    collection_seconds: float | None = None
    truncation: dict[str, JsonValue] | None = None
    created_at: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The stored form: the keys it was published with."""
        return self.model_dump(mode="json", exclude_unset=True)

    @property
    def modules(self) -> list[str] | None:
        """The module suffixes the statistics were collected for (None: every editable layer)."""
        modules = (self.settings or {}).get("modules")
        return [str(m) for m in modules] if isinstance(modules, list) else None


class MalformedStatistics(ServiceUnavailable):
    """A stored statistics manifest this version cannot read."""

    def __init__(self, prefix: str, why: str) -> None:
        super().__init__(
            f"the manifest of the statistics at {prefix} cannot be read ({why}): remove {prefix} from the store "
            "and collect the concept again (POST /concepts)"
        )


def read_statistics_manifest(prefix: str, data: Mapping[str, Any]) -> StatisticsManifest:
    """The stored manifest of the statistics at ``prefix`` as a record.

    Raises:
        MalformedStatistics: a field is missing, wrong or unknown.
    """
    try:
        return StatisticsManifest.model_validate(data)
    except ValidationError as exc:
        raise MalformedStatistics(prefix, first_validation_error(exc)) from exc


def stats_manifest(ctx: Context, prefix: str) -> StatisticsManifest | None:
    """The manifest of the statistics at ``prefix``; ``None`` while they are not published."""
    stored = ctx.reads.immutable_json(manifest_key(prefix))  # content-addressed: written once
    return None if stored is None else read_statistics_manifest(prefix, stored)


def publish_statistics(ctx: Context, prefix: str, file: Path, manifest: Callable[[], StatisticsManifest]) -> None:
    """Store the statistics file, then its manifest (last: the statistics exist exactly when it does),
    built once the file is stored (so its ``created_at`` says when they were published)."""
    ctx.storage.put_file(statistics_key(prefix), file)
    ctx.storage.put_json(manifest_key(prefix), manifest().to_json())


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
