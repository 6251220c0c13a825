"""The reads of a universe's documents that both the submit path (:mod:`service.universes.service`)
and the retention rule (:mod:`service.universes.retention`) need.

Their keys are spelled in :mod:`service.storage.keys`; :mod:`service.universes.service` says what each holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from service.context import Context
from service.engrams.manifest import UniverseManifest, read_manifest
from service.errors import ServiceUnavailable, first_validation_error
from service.models.registry import get_model
from service.storage.keys import (
    MODEL_UNIVERSES,
    current_pointer_key,
    model_universes_prefix,
    universe_manifest_key,
    universe_plan_key,
    universe_prefix,
    universe_request_key,
    usage_key,
)
from service.storage.records import StoredRecord
from service.storage.stored_json import find_record
from service.universes.spec import UniverseRequest


def valid_universe_id(universe_id: str) -> bool:
    return len(universe_id) == 32 and all(c in "0123456789abcdef" for c in universe_id)


def find_request(ctx: Context, universe_id: str, *, recent: bool = False) -> UniverseRequest | None:
    """The universe's request; ``recent``: as of at most a second ago (views only)."""
    if not valid_universe_id(universe_id):
        return None
    key = universe_request_key(universe_id)
    data = ctx.reads.recent_json(key) if recent else ctx.storage.find_json(key)
    return None if data is None else UniverseRequest.stored(key, data)


def find_manifest(ctx: Context, universe_id: str, *, recent: bool = False) -> UniverseManifest | None:
    """The universe's manifest: it is built exactly when this exists.

    Read from storage itself (a job deciding whether to build, a request deciding whether to
    dispatch one), or, for views (``recent``), as of at most a second ago. Never cached for longer:
    the manifest is written once, but the retention rule may delete it, and a process must not go
    on reading a universe that another one evicted.

    Raises:
        MalformedManifest: the stored manifest is of another format or not a manifest (named).
    """
    if not valid_universe_id(universe_id):
        return None
    data = _manifest_json(ctx, universe_id, recent)
    return None if data is None else read_manifest(universe_id, data)


def _manifest_json(ctx: Context, universe_id: str, recent: bool) -> dict[str, Any] | None:
    key = universe_manifest_key(universe_id)
    if not recent:
        return ctx.storage.find_json(key)
    hit, manifest = ctx.reads.peek(key)
    if hit and manifest is not None:
        return dict(manifest)
    ctx.reads.forget(key)  # a cached miss is never trusted: a build's publication shows at once
    return ctx.reads.recent_json(key)


def stage_key(universe_id: str, stage: str) -> str:
    """A partial build stage's manifest (:mod:`service.universes.build`): written once its parts are."""
    return f"{universe_prefix(universe_id)}stages/{stage}.json"


def build_target_key(universe_id: str, job_id: str) -> str:
    """The groups job ``job_id`` builds of the universe (one stage): what its helpers help with."""
    return f"{universe_prefix(universe_id)}builds/{job_id}.json"


def find_stages(ctx: Context, universe_id: str) -> list[UniverseManifest]:
    """The partial build stages stored so far (their manifests), in name order.

    Read from storage itself, never cached: the retention rule deletes them with the universe.

    Raises:
        MalformedManifest: a stored stage is of another format or not a manifest (named).
    """
    prefix = universe_prefix(universe_id) + "stages/"
    found = []
    for key in sorted(ctx.storage.list(prefix)):
        data = ctx.storage.find_json(key)
        if data is not None:  # deleted since the listing (evicted)
            found.append(read_manifest(universe_id, data, partial=True))
    return found


def find_usage(ctx: Context, universe_id: str, *, recent: bool = False) -> dict[str, Any]:
    """The universe's usage record (``{}`` when none was written: a universe from before them)."""
    key = usage_key(universe_id)
    found = ctx.reads.recent_json(key) if recent else ctx.storage.find_json(key)
    return dict(found or {})


class StoredPlan(StoredRecord):
    """A universe's ``plan.json``, written first by its build: input group -> its layers, and the
    layers in layout order. The universe's view counts its groups while it builds. Its keys are
    those it always had (no ``format_version``: the shape never changed)."""

    groups: dict[str, tuple[str, ...]]
    layers: tuple[str, ...]


def read_plan(universe_id: str, data: Mapping[str, Any]) -> StoredPlan:
    """The stored plan of ``universe_id`` as a record.

    Raises:
        ServiceUnavailable: a field is missing, wrong or unknown (named).
    """
    try:
        return StoredPlan.model_validate(data)
    except ValidationError as exc:
        raise ServiceUnavailable(
            f"the plan of universe {universe_id} cannot be read ({first_validation_error(exc)}): delete the universe "
            f"(DELETE /universes/{universe_id}) and request it again to rebuild it"
        ) from exc


def find_plan(ctx: Context, universe_id: str) -> StoredPlan | None:
    """The universe's plan (None: its build has not started). Written once, first: cached once found."""
    found = ctx.reads.immutable_json(universe_plan_key(universe_id))
    return None if found is None else read_plan(universe_id, found)


class CurrentUniverse(StoredRecord):
    """A model's current universe (``models/<id>/universes/current.json``): what a request that names
    no universe or reference is resolved against.

    Its keys are those it was always stored with (no ``format_version``: the shape never changed).

    Attributes:
        members: concept name -> its statistics prefix.
        rcond: the universe's cut (None: the default).
        since: when it became current (UTC, ISO 8601).
    """

    universe_id: str
    members: dict[str, str]
    rcond: float | None
    since: str


class MalformedPointer(ServiceUnavailable):
    """A stored current-universe pointer this version cannot read."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(
            f"the current universe {key} cannot be read ({why}): delete it, and the next request (or "
            "POST /models/{id}/universes) makes a current universe again"
        )


def read_current_pointer(key: str, data: Mapping[str, Any]) -> CurrentUniverse:
    """The stored pointer at ``key`` as a record.

    Raises:
        MalformedPointer: a field is missing or wrong, or one is unknown.
    """
    try:
        return CurrentUniverse.model_validate(data)
    except ValidationError as exc:
        raise MalformedPointer(key, first_validation_error(exc)) from exc


def current_pointer(ctx: Context, model_id: str) -> CurrentUniverse | None:
    """The model's current universe, or None.

    Raises:
        MalformedPointer, UnreadableRecord: what is stored there is not a pointer (named).
    """
    key = current_pointer_key(model_id)
    found = find_record(ctx.storage, key)
    return None if found is None else read_current_pointer(key, found)


def current_universe_ids(ctx: Context) -> set[str]:
    """The universes that are some model's current one."""
    keys = [k for k in ctx.storage.list(MODEL_UNIVERSES) if k.endswith("/current.json")]
    return {read_current_pointer(key, found).universe_id for key in keys if (found := ctx.storage.find_json(key))}


def known_universe_ids(ctx: Context) -> set[str]:
    """Every universe ever requested (each has a marker under the model IDs that used it)."""
    ids = {k.rsplit("/", 1)[-1] for k in ctx.storage.list(MODEL_UNIVERSES) if "/known/" in k}
    return {uid for uid in ids if valid_universe_id(uid)}


def model_universe_ids(ctx: Context, model_id: str) -> list[str]:
    """The universes requested on ``model_id`` (404 when the model is not registered)."""
    get_model(ctx, model_id)
    ids = [k.rsplit("/", 1)[-1] for k in ctx.storage.list(model_universes_prefix(model_id) + "known/")]
    return [uid for uid in ids if valid_universe_id(uid)]
