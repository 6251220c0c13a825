"""Model registrations rewritten in the current stored format (``engram-service migrate``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.context import Context
from service.engine.model_files import ModelSourceError
from service.errors import first_validation_error
from service.models.record import MODEL_FORMAT_VERSION, ModelRecord, folder_kind
from service.storage.keys import MODELS, model_key
from service.storage.stored_json import UnreadableRecord, find_record


@dataclass
class Migration:
    """What a migration changed and what it refused: the key, and in words what or why."""

    changed: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)

    def extend(self, other: Migration) -> None:
        self.changed.extend(other.changed)
        self.refused.extend(other.refused)

    def readable(self, ctx: Context, key: str) -> dict[str, Any] | None:
        """The record under ``key`` as stored, or None: gone since it was listed, or refused here,
        naming why, when it is not a JSON object (the migration goes on with the others)."""
        try:
            return find_record(ctx.storage, key)
        except UnreadableRecord as exc:
            self.refused.append((key, f"{exc.why}: restore it from a backup or delete it"))
            return None


def migrate_models(ctx: Context, *, dry_run: bool = False) -> Migration:
    """Give every registration of an older format the current one.

    0.1.0's and version 1's differ from it in the version, and in ``kind`` where they lack it: it is
    recorded as registration decides it, from the folder's ``config.json`` (:func:`folder_kind`), never
    assumed to be text (an image classifier registered before kinds existed would be fed text). A
    registration whose folder cannot say is refused by name and left as it was. A registration without
    recorded file identities keeps none; its first check records them.
    """
    done = Migration()
    for key in ctx.storage.list(MODELS):
        if not key.endswith(".json"):
            continue
        data = done.readable(ctx, key)
        if data is None or data.get("format_version") == MODEL_FORMAT_VERSION:
            continue
        try:
            record = current_registration(data)
        except Unmigratable as exc:
            done.refused.append((key, str(exc)))
            continue
        if not dry_run:
            ctx.storage.put_json(key, record.to_json())
        what = f"format_version {data.get('format_version')!r} -> {MODEL_FORMAT_VERSION}"
        done.changed.append((key, what if "kind" in data else f"{what}, kind {record.kind!r} from its config.json"))
    return done


class Unmigratable(Exception):
    """Why one registration cannot be migrated, in words."""


def current_registration(data: Mapping[str, Any]) -> ModelRecord:
    """A stored registration of any version, in the current format (``kind`` read from its folder
    when it lacks one).

    Raises:
        Unmigratable: it is not a registration, or its folder does not say what the model reads.
    """
    path = data.get("path")
    if "kind" in data or data.get("format_version") == MODEL_FORMAT_VERSION:
        kind = data.get("kind")
    elif isinstance(path, str) and path:
        try:
            kind = folder_kind(Path(path))
        except ModelSourceError as exc:
            raise Unmigratable(
                f"its kind (text or image) is not recorded and its folder {path} cannot say ({exc}): register it again"
            ) from None
    else:
        kind = None  # not a registration: refused below, naming what is wrong
    try:
        return ModelRecord.model_validate({**data, "kind": kind, "format_version": MODEL_FORMAT_VERSION})
    except ValidationError as exc:
        raise Unmigratable(
            f"not a model registration this version can read ({first_validation_error(exc)}): register it again"
        ) from None


def registration_of_any_version(ctx: Context, model_id: str) -> ModelRecord | None:
    """A registration, migrated or not (what a dry run, which rewrites nothing, reads); None when
    there is none, or it cannot be migrated."""
    try:
        data = find_record(ctx.storage, model_key(model_id))
        return None if data is None else current_registration(data)
    except (Unmigratable, UnreadableRecord):
        return None
