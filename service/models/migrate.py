"""Model registrations rewritten in the current stored format (``engram-service migrate``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from service.context import Context
from service.errors import first_validation_error
from service.models.record import ModelRecord
from service.models.stored import FORMAT_VERSION
from service.storage.keys import MODELS, model_key


@dataclass
class Migration:
    """What a migration changed and what it refused: the key, and in words what or why."""

    changed: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)

    def extend(self, other: Migration) -> None:
        self.changed.extend(other.changed)
        self.refused.extend(other.refused)


def migrate_models(ctx: Context, *, dry_run: bool = False) -> Migration:
    """Give every registration of an older format the current one (0.1.0's lack only the version:
    a registration without recorded file identities keeps none; its first check records them)."""
    done = Migration()
    for key in ctx.storage.list(MODELS):
        if not key.endswith(".json"):
            continue
        data = ctx.storage.get_json(key)
        if data.get("format_version") == FORMAT_VERSION:
            continue
        try:
            record = ModelRecord.model_validate({**data, "format_version": FORMAT_VERSION})
        except ValidationError as exc:
            done.refused.append(
                (key, f"not a model registration this version can read ({first_validation_error(exc)}): register it again")
            )
            continue
        if not dry_run:
            ctx.storage.put_json(key, record.to_json())
        done.changed.append((key, f"format_version {data.get('format_version')!r} -> {FORMAT_VERSION}"))
    return done


def registration_of_any_version(ctx: Context, model_id: str) -> ModelRecord | None:
    """A registration, migrated or not (what a dry run, which rewrites nothing, reads)."""
    data = ctx.storage.find_json(model_key(model_id))
    try:
        return None if data is None else ModelRecord.model_validate({**data, "format_version": FORMAT_VERSION})
    except ValidationError:
        return None
