"""Concepts rewritten in the current stored format (``engram-service migrate``).

0.1.0 wrote a concept in the keys :class:`~service.concepts.record.ConceptRecord` reads, without
``format_version``: its migration adds the version and changes nothing else. A document that is not
a concept this version can read is refused by name (it is left as it was).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from service.concepts.record import ConceptRecord
from service.context import Context
from service.errors import first_validation_error
from service.models.migrate import Migration
from service.models.stored import FORMAT_VERSION
from service.storage.keys import CONCEPTS
from service.storage.stored_json import UnreadableRecord, find_record


def migrate_concepts(ctx: Context, *, dry_run: bool = False) -> Migration:
    """Give every concept of an older format the current one; idempotent."""
    done = Migration()
    for key in _concept_keys(ctx):
        data = done.readable(ctx, key)
        if data is None or data.get("format_version") == FORMAT_VERSION:
            continue
        try:
            record = _current(data)
        except ValidationError as exc:
            why = first_validation_error(exc)
            done.refused.append((key, f"not a concept this version can read ({why}): delete it and post it again"))
            continue
        if not dry_run:
            ctx.storage.put_json(key, record.to_json())
            ctx.reads.forget(key)
        done.changed.append((key, f"format_version {data.get('format_version')!r} -> {FORMAT_VERSION}"))
    return done


def concepts_of_any_version(ctx: Context) -> list[ConceptRecord]:
    """Every concept that is readable, migrated or not (what a dry run, which rewrites nothing, reads)."""
    found = []
    for key in _concept_keys(ctx):
        try:
            data = find_record(ctx.storage, key)
            if data is not None:
                found.append(_current(data))
        except (ValidationError, UnreadableRecord):
            continue  # refused by migrate_concepts, by name
    return found


def _concept_keys(ctx: Context) -> list[str]:
    return [k for k in ctx.storage.list(CONCEPTS) if k.endswith(".json")]


def _current(data: Mapping[str, Any]) -> ConceptRecord:
    return ConceptRecord.model_validate({**data, "format_version": FORMAT_VERSION})
