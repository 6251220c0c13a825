"""A published statistics' manifest and header, and their publication.

The collection job writes the statistics file, then the manifest (:func:`publish_statistics`): the
statistics exist exactly when the manifest does, and never change after (content-addressed), so
readers cache both for the life of the process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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


def header_metadata(storage: Storage, prefix: str) -> dict[str, Any]:
    """The metadata of the statistics file at ``prefix`` (``layer_group`` decoded), read by range:
    its header only, a few kilobytes of a file of gigabytes."""
    key = statistics_key(prefix)
    length = int.from_bytes(b"".join(storage.iter_range(key, 0, 7)), "little")
    header = json.loads(b"".join(storage.iter_range(key, 8, 8 + length - 1)))
    return {k: json.loads(v) if k == "layer_group" else v for k, v in (header.get("__metadata__") or {}).items()}
