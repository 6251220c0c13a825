"""Universes: the concept statistics an edit is measured against, as stored objects.

A universe is a set of concept statistics on one model plus the pseudo-inverse cut: its ID is a
content hash of the model digest (model IDs of the same weights share universes), the members'
statistics prefixes (which carry the dataset and collection-settings digests) and ``rcond``, so it
is never mutated. Its build (a ``universe`` job,
or the first variant that needs it) decomposes each input group of ``Σ_U`` once and stores every
member's engram; variants are then arithmetic on those (:mod:`service.variants.build`).

Storage layout:

- ``universes/<id>/request.json``: model, members (names, statistics, dataset digests), ``rcond``,
  the job building it (written when first asked for; the only mutable part: its ``job_id``)
- ``universes/<id>/plan.json``: written first by the build: its input groups and layers
- ``universes/<id>/groups/<quoted group>.safetensors``: the group's pseudo-inverse factors (float64)
- ``universes/<id>/engrams/<member key>.safetensors`` (+ ``.json``: per-layer norms): ``E_k,l``; for a
  universe built in stages (a request's layers first: :mod:`service.universes.build`), one file per
  member and stage, ``engrams/<member key>~<stage>.safetensors``
- ``universes/<id>/stages/<stage>.json``: a stage's manifest (its groups; the others ``deferred``),
  written once its parts are; ``builds/<job id>.json``: the groups a job builds (what its helpers help with)
- ``universes/<id>/manifest.json``: written last, once every group is built; the universe exists
  exactly when it does (a universe with stages only is ``partial``)
- ``universes/<id>/usage.json``: when it was last used, its projected bytes, when it was evicted
  (:mod:`service.universes.retention`: the storage budget and the retention rule)
- ``model-universes/<quoted model id>/current.json``: the model's current universe
- ``model-universes/<quoted model id>/known/<id>``: one empty marker per universe of the model
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any
from urllib.parse import unquote

from api_schemas import Universe, UniverseSubmission
from service.concepts.service import default_reference, ready_statistics
from service.context import Context
from service.engrams.manifest import UniverseManifest
from service.errors import Conflict, NotFound
from service.jobs import callbacks
from service.jobs.admission import admit
from service.jobs.records import JobRecord, UniversePayload
from service.jobs.store import FINISHED, job_answer, new_job, utc_now
from service.jobs.submit import attach_callbacks
from service.models.registry import get_model
from service.statistics.key import StatsKey
from service.storage.keys import (
    MODEL_UNIVERSES,
    current_pointer_key,
    known_universe_key,
    universe_prefix,
    universe_request_key,
)
from service.storage.stored_json import skip_unreadable
from service.universes import retention
from service.universes.holdings import busy_jobs
from service.universes.records import (
    CurrentUniverse,
    current_pointer,
    find_manifest,
    find_plan,
    find_request,
    find_usage,
    model_universe_ids,
)
from service.universes.spec import UniverseRequest, UniverseSpec, make_spec, settings_digest


def member_keys(prefixes: Sequence[str]) -> dict[str, str]:
    """prefix -> the name of its engram file: the dataset digest, plus the settings digest where
    two members hold the same records collected with other settings."""
    digests = [StatsKey.parse(p).dataset_digest for p in prefixes]
    return {p: d if digests.count(d) == 1 else f"{d}-{settings_digest(p)}" for p, d in zip(prefixes, digests, strict=True)}


# ---------------------------------------------------------------- recording


def record_universe(ctx: Context, spec: UniverseSpec, job_id: str | None) -> UniverseRequest:
    """Store what ``spec`` is (once) and which job builds it; call under ``ctx.lock``.

    The job is replaced only when the recorded one can no longer build it: it failed, was
    cancelled or is gone, or it finished and the universe was evicted since (the callers pass a
    job only when no manifest exists).
    """
    uid = spec.universe_id
    marker = known_universe_key(spec.model_id, uid)
    if not ctx.storage.exists(marker):  # listed under every model ID (of the same weights) that used it
        ctx.storage.put_bytes(marker, b"")
    existing = find_request(ctx, uid)
    if existing is not None:
        job = ctx.jobs.get(existing.job_id) if existing.job_id else None
        if job is not None and job.status not in FINISHED or job_id is None:
            return existing
        record = existing.model_copy(update={"job_id": job_id})
    else:
        record = UniverseRequest.of(spec, job_id, utc_now())
    ctx.storage.put_json(universe_request_key(uid), record.model_dump(mode="json"))
    ctx.reads.forget(universe_request_key(uid))
    return record


def set_current(ctx: Context, spec: UniverseSpec) -> None:
    """Make ``spec`` the model's current universe (call under ``ctx.lock``)."""
    pointer = CurrentUniverse(
        universe_id=spec.universe_id,
        members={m.name: m.stats for m in spec.members},
        rcond=spec.rcond,
        since=utc_now(),
    )
    previous = current_pointer(ctx, spec.model_id)
    if previous is None or previous.universe_id != spec.universe_id:
        ctx.storage.put_json(current_pointer_key(spec.model_id), pointer.to_json())


# ---------------------------------------------------------------- POST /models/{id}/universes


def _needs_build(ctx: Context, universe_id: str) -> bool:
    """Whether requesting this universe starts a job: it is neither stored nor being built."""
    if find_manifest(ctx, universe_id) is not None:
        return False
    record = find_request(ctx, universe_id)
    running = ctx.jobs.get(record.job_id) if record and record.job_id else None
    return running is None or running.status in FINISHED


def submit_universe(
    ctx: Context, model_id: str, concepts: Sequence[str] | None, rcond: float | None, callback_url: str | None = None
) -> tuple[Universe, JobRecord | None]:
    """Build the universe of ``concepts`` (default: every concept ready on the model) and make it
    the model's current one.

    A universe that is not stored (new, or evicted) must fit ``ENGRAM_UNIVERSE_BYTES_BUDGET``,
    after evicting unused universes if need be; that is checked before anything is written.

    Returns:
        (universe view, its build job; None when it is built already).

    Raises:
        NotFound, Conflict: an unknown model or concept, a concept without ready statistics, or no
            ready concept at all.
        UniverseBudgetExceeded: a 409 stating the projected bytes and the budget; nothing changed.
    """
    urls = callbacks.check_optional_url(callback_url, ctx.settings)
    model = get_model(ctx, model_id)
    names = sorted(set(concepts)) if concepts else default_reference(ctx, model_id)
    if not names:
        raise Conflict(f"no concept has ready statistics on model {model_id}")
    spec = make_spec(model, ready_statistics(ctx, model_id, names), rcond)
    uid = spec.universe_id
    job = created = None
    with ctx.lock:
        if _needs_build(ctx, uid):  # first, with make_room: a refusal leaves everything as it was
            admit(ctx)
        projected = retention.make_room(ctx, spec)  # first: a refusal leaves everything as it was
        set_current(ctx, spec)
        if find_manifest(ctx, uid) is not None:
            record_universe(ctx, spec, None)
            retention.note_use(ctx, uid)
        else:
            record = find_request(ctx, uid)
            running = ctx.jobs.get(record.job_id) if record and record.job_id else None
            if running is not None and running.status not in FINISHED:
                job = attach_callbacks(ctx, running, urls)  # already building: that job calls back too
                retention.note_use(ctx, uid)
            else:
                payload = UniversePayload(universe_id=uid, model_id=model_id)
                created = ctx.jobs.create(new_job("universe", payload, unit="steps", callback_urls=urls))
                record_universe(ctx, spec, created.job_id)
                retention.note_use(ctx, uid, projected=projected, rebuilding=True)
    if created is not None:  # enqueued only after the request it reads is saved
        ctx.dispatch(created)
        job = ctx.jobs.get(created.job_id)
    return universe_view(ctx, uid), job


# ---------------------------------------------------------------- DELETE /universes/{id}


def delete_universe(ctx: Context, universe_id: str) -> int:
    """Delete a universe and everything it stores (admin only: the route's scope).

    Refused (409, nothing deleted) while a job not finished builds or reads it (the job is named:
    cancel it or wait), and while it is some model's current universe: requests without
    ``universe`` resolve to it, so deleting it would either change silently what those requests
    give (another universe, other variant IDs) or have the next one rebuild it (freeing nothing);
    the admin makes another universe current first. Variants built from it keep their files.

    Returns:
        The bytes of factors and engrams freed.

    Raises:
        NotFound: no such universe.
        Conflict: a job needs it, or it is a model's current universe.
    """
    with ctx.lock:
        request = find_request(ctx, universe_id)
        if request is None:
            raise NotFound(f"universe {universe_id} does not exist (GET /models/{{id}}/universes lists a model's)")
        jobs = set(busy_jobs(ctx).get(universe_id, []))
        builder = ctx.jobs.get(request.job_id) if request.job_id else None
        if builder is not None and builder.status not in FINISHED:
            jobs.add(builder.job_id)  # a calibration builds the universe it needs too
        if jobs:
            raise Conflict(
                f"universe {universe_id} is being built or read by job(s) {', '.join(sorted(jobs))}: nothing was "
                "deleted. Wait until they finish (GET /jobs/{id}) or cancel them (DELETE /jobs/{id}), then delete it"
            )
        models = _current_of(ctx, universe_id)
        if models:
            raise Conflict(
                f"universe {universe_id} is the current universe of model(s) {', '.join(models)}: requests without "
                '"universe" use it, so it is not deleted. Make another universe current first (POST '
                f"/models/{models[0]}/universes with other concepts), then delete it"
            )
        return retention.remove_universe(ctx, universe_id)


def _current_of(ctx: Context, universe_id: str) -> list[str]:
    """The model IDs whose current universe this is."""
    found = []
    for key in ctx.storage.list(MODEL_UNIVERSES):
        if key.endswith("/current.json") and (ctx.storage.find_json(key) or {}).get("universe_id") == universe_id:
            found.append(unquote(key.removeprefix(MODEL_UNIVERSES).removesuffix("/current.json")))
    return sorted(found)


# ---------------------------------------------------------------- views


def universe_view(ctx: Context, universe_id: str, current: str | None = None) -> Universe:
    """A universe as the API shows it (the contract's :class:`~api_schemas.Universe`): members, status,
    groups done/total, bytes, last use.

    Status: ``ready`` (its manifest exists), ``building`` (a job builds it), ``partial`` (requests
    that edit some layers built their input groups; the others are built when a request needs them),
    ``evicted`` (the retention rule deleted its parts: ``bytes`` 0, ``evicted_at`` set; requesting it
    again rebuilds it under the same ID), or ``failed``.
    """
    request = find_request(ctx, universe_id, recent=True)
    if request is None:
        raise NotFound(f"universe {universe_id} does not exist")
    if current is None:
        pointer = current_pointer(ctx, request.model_id)
        current = pointer.universe_id if pointer else ""
    # The job first, then the manifest: see registry.concept_model_state.
    job = ctx.jobs.get(request.job_id) if request.job_id else None
    manifest = find_manifest(ctx, universe_id, recent=True)
    usage = find_usage(ctx, universe_id, recent=True)
    view: dict[str, Any] = {
        "universe_id": universe_id,
        "model_id": request.model_id,
        "members": [{"name": m.name, "dataset_digest": m.dataset_digest} for m in request.members],
        "rcond": request.rcond,
        "current": universe_id == current,
        "job_id": request.job_id,
        "created_at": request.created_at,
        "last_used": usage.get("last_used"),
        "projected_bytes": (usage.get("projected") or {}).get("total"),
        "evicted_at": None,
    }
    return Universe.model_validate({**view, **_state_fields(ctx, universe_id, manifest, job, usage)})


def _state_fields(
    ctx: Context, universe_id: str, manifest: UniverseManifest | None, job: JobRecord | None, usage: dict[str, Any]
) -> dict[str, Any]:
    """Status, groups, bytes and build seconds: from the manifest (ready), the usage record (evicted),
    or the stored groups and stages (building, partial, failed)."""
    if manifest is not None:
        groups = len(manifest.groups)
        return {
            "status": "ready",
            "groups": {"done": groups, "total": groups},
            "bytes": manifest.bytes.total,
            "bytes_detail": manifest.bytes.model_dump(),
            "build_seconds": dict(manifest.seconds),
        }
    building = job is not None and job.status not in FINISHED
    unbuilt = {"bytes": None, "bytes_detail": None, "build_seconds": None}
    if not building and usage.get("evicted_at"):
        return {
            **unbuilt,
            "status": "evicted",
            "groups": {"done": 0, "total": None},
            "bytes": 0,
            "evicted_at": usage["evicted_at"],
        }
    plan = find_plan(ctx, universe_id)
    done = len(ctx.storage.list(universe_prefix(universe_id) + "groups/"))
    # Stages stored and no build running: the groups earlier requests needed are built, the others
    # wait for a request that needs them (service.universes.build); not a failure.
    partial = not building and bool(ctx.storage.list(universe_prefix(universe_id) + "stages/"))
    status = "building" if building else "partial" if partial else "failed"
    return {**unbuilt, "status": status, "groups": {"done": done, "total": len(plan.groups) if plan else None}}


def universe_submission(
    ctx: Context, model_id: str, concepts: Sequence[str] | None, rcond: float | None, callback_url: str | None = None
) -> UniverseSubmission:
    """:func:`submit_universe` as the route answers it: the universe, and its build job when one runs."""
    universe, job = submit_universe(ctx, model_id, concepts, rcond, callback_url)
    return UniverseSubmission(universe=universe, job=job_answer(job) if job else None)


def list_universes(ctx: Context, model_id: str) -> list[Universe]:
    """Every universe of a model (404 when it is not registered), the current one marked, oldest first."""
    ids = model_universe_ids(ctx, model_id)
    # A pointer that cannot be read marks none current here (logged by name; a request it decides refuses it).
    pointer = skip_unreadable(current_pointer_key(model_id), partial(current_pointer, ctx, model_id))
    current = pointer.universe_id if pointer else ""
    # One universe whose records cannot be read is left out, logged by name (reading it by ID refuses it).
    found = (skip_unreadable(universe_request_key(uid), partial(universe_view, ctx, uid, current)) for uid in ids)
    views = [view.model_copy(update={"model_id": model_id}) for view in found if view is not None]
    return sorted(views, key=lambda v: v.created_at.isoformat() if v.created_at else "")
