"""What universes take in storage, the budget they must fit in, and the retention rule.

Bytes. A universe's stored parts are its input groups' pseudo-inverse factors (float64) and every
member's engrams (one file per member). Before a new universe is built,
:func:`~service.universes.projection.project_universe` estimates both from what is already known,
reading no tensor (the layout, the checkpoint's and the statistics' headers): an upper bound of
what the build stores.

Budget. ``ENGRAM_UNIVERSE_BYTES_BUDGET`` bounds the bytes of every universe together (0: no bound).
A request that would build a new universe (``POST /models/{id}/universes``, a variant whose universe
is not stored) is checked under the registry lock before anything is written: stored universes,
plus the projected bytes of builds still running, plus the new projection must fit. When they do
not, the retention rule is applied first (least recently used first, only as many as needed); when
even evicting every evictable universe would not make room, nothing is deleted or written and the
request is a 409 (:class:`UniverseBudgetExceeded`).

Retention. A universe is *in use*, and never deleted, while it is the current universe of some
model, a job not finished yet builds it or reads it (a ``universe`` job, a ``variant`` job of it),
or it was used within ``ENGRAM_UNIVERSE_RETENTION_S`` (requested, a variant requested from it, or
built: :func:`note_use`). Any other universe with stored parts is *evictable*: deleted to make room,
and by the API's janitor every ``ENGRAM_JANITOR_INTERVAL_S`` (:func:`expire_unused`). Eviction
deletes the manifest first (the universe stops existing at once), then the plan, the groups, the
engrams and the build's part records; it keeps ``request.json`` and ``usage.json``, so ``GET /universes/{id}`` shows it as
``evicted`` (bytes 0, ``evicted_at``) and requesting it again (a POST, or a variant of it) rebuilds
it under the same ID, with the same groups and member keys.

Keys. Every use made by a request records which API key made it (``users``: key identity → last
use; the identity is the key's name or fingerprint from :mod:`service.api.auth`, never the key; every
caller is one key, ``anonymous``, without auth). Every key that used a universe within the retention
age keeps it alive and is charged its bytes in full, a universe several keys use included
(:mod:`service.universes.shares` says why). A request that would take its key's charge past
``ENGRAM_UNIVERSE_KEY_SHARE`` × the budget is a 409 (:class:`UniverseShareExceeded`) naming the
setting and the key's charge, whatever room the budget has. When another key needs room and
evicting unused universes is not enough, the universes only other keys keep alive are evictable too
(not a current universe, not one a job needs), the most charged key's least recently used first, and
only from keys charged more than the requesting key will be once its universe is built: a key can
push out a heavier one, never a lighter one, and using another key's universe never shields it.

Volume. For ``file://`` storage the budget is capped at ``ENGRAM_UNIVERSE_VOLUME_FRACTION`` of the
store's volume (used + free bytes, :func:`service.universes.holdings.effective_budget`), as the
configured budget may exceed the disk; the cap is logged once per process (at start-up: the
janitor's first pass) and shown by ``GET /universes/usage``. S3 has no volume: nothing is checked
there, and the usage says so.

Usage record: ``universes/<id>/usage.json`` ``{last_used, users, projected, evicted_at,
evicted_bytes}``, the only mutable part of a universe besides its request's ``job_id``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone

from api_schemas.universes import UniverseBytes, UniverseKeyUsage, UniverseStatusCounts, UniverseUsage
from service.context import Context
from service.errors import Conflict, ProblemDetails
from service.jobs.admission import job_owner
from service.jobs.store import FINISHED, utc_now
from service.observability import record_universe_eviction, record_universe_refusal, set_universe_gauges
from service.storage.keys import MODEL_UNIVERSES, universe_prefix, universe_request_key, usage_key
from service.universes.holdings import (
    Budget,
    StoredUniverse,
    UniverseStorage,
    parse_time,
    read_users,
    size_words,
    stored_parts,
    universe_storage,
)
from service.universes.projection import Projection, project_universe
from service.universes.records import find_manifest, find_request, find_usage, model_universe_ids
from service.universes.shares import displaceable, key_holdings, share_overrun
from service.universes.spec import UniverseSpec

log = logging.getLogger("engram.universes")

# A use is written at most this often per universe: a burst of variant requests costs one write.
_USE_WRITE_INTERVAL_S = 60.0


class UniverseBudgetExceeded(Conflict):
    """A new universe does not fit ``ENGRAM_UNIVERSE_BYTES_BUDGET`` even after evicting unused ones.

    A 409, not a 413 or 507: the request itself is fine (its body is tiny, and 5xx would say the
    service failed); it conflicts with what storage holds now, and the user can resolve it.
    """

    title, slug = "Universe storage budget exceeded", "universe-budget-exceeded"

    def __init__(self, detail: str, *, numbers: Mapping[str, int | str]) -> None:
        super().__init__(detail)
        self.numbers = dict(numbers)

    def to_problem(self) -> ProblemDetails:
        """The problem with its figures as extension members (RFC 9457 §3.2): ``projected_bytes``,
        ``budget_bytes``, ``held_bytes`` (stored and reserved by the other universes) and
        ``evictable_bytes`` (what evicting every unused one would free)."""
        return super().to_problem().with_members(**self.numbers)


class UniverseShareExceeded(UniverseBudgetExceeded):
    """A new universe would take the requesting key past ``ENGRAM_UNIVERSE_KEY_SHARE`` of the budget.

    A 409 like the budget's (the request is fine; what this key keeps alive conflicts with it), with
    ``key``, ``key_bytes`` (its charge: what every universe it keeps alive holds) and ``share_bytes``.
    """

    title, slug = "Universe storage share of this API key exceeded", "universe-key-share-exceeded"


# ---------------------------------------------------------------- use


def note_use(
    ctx: Context,
    universe_id: str,
    *,
    projected: Projection | None = None,
    rebuilding: bool = False,
    key: str | None = None,
) -> None:
    """Record that ``universe_id`` was used now: requested, a variant requested from it, or built.

    Call it under ``ctx.lock`` where a write decision depends on it (the submit paths); the build
    job's call at its end may run without (a lost race costs at most one ``last_used`` update).

    Args:
        projected: the estimate the budget checked (recorded with a request that builds it).
        rebuilding: a build of it was just requested: an earlier eviction no longer describes it.
        key: the identity of the API key whose request used it; by default the request's own
            (:data:`service.jobs.admission.job_owner`; none in a job: a job's use is nobody's).
    """
    key = key or job_owner.get()
    usage = find_usage(ctx, universe_id)
    now = datetime.now(timezone.utc)
    users = read_users(usage)
    changed = projected is not None or (rebuilding and usage.get("evicted_at") is not None)
    changed = changed or (key is not None and _stale(users.get(key), now))
    if not changed and not _stale(parse_time(usage.get("last_used")), now):
        return
    usage["last_used"] = utc_now()
    if key is not None:
        users[key] = now
    # Only uses within the retention age mean anything; older ones are dropped, so the record stays small.
    keep = ctx.settings.universe_retention_s
    usage["users"] = {k: t.isoformat() for k, t in sorted(users.items()) if (now - t).total_seconds() < keep or k == key}
    if projected is not None:
        usage["projected"] = projected.to_json()
    if rebuilding:
        usage["evicted_at"] = None
    ctx.storage.put_json(usage_key(universe_id), usage)
    ctx.reads.forget(usage_key(universe_id))


def _stale(last: datetime | None, now: datetime) -> bool:
    """A use recorded at ``last`` is worth writing again (a burst of uses costs one write a minute)."""
    return last is None or (now - last).total_seconds() >= _USE_WRITE_INTERVAL_S


def mark_built(ctx: Context, universe_id: str) -> None:
    """The build job's hook at its end (after ``manifest.json``): the universe was just used."""
    note_use(ctx, universe_id, rebuilding=True)


# ---------------------------------------------------------------- budget


def make_room(ctx: Context, spec: UniverseSpec, key: str | None = None) -> Projection | None:
    """Check that a new build of ``spec`` fits the budget and ``key``'s share of it, evicting unused
    universes (and, for ``key``, those only heavier keys keep alive) if it must; call under
    ``ctx.lock``, before anything of the request is written.

    A universe already stored, or being built, needs no room. Evicts only when that makes room.

    Args:
        key: the identity of the API key whose request builds it; by default the request's own
            (:data:`service.jobs.admission.job_owner`). None outside a request: no share is
            checked and only unused universes may be evicted.

    Returns:
        The projection of the build (None when it needs none: stored, or being built).

    Raises:
        UniverseShareExceeded: it would take ``key`` past its share (nothing deleted or written).
        UniverseBudgetExceeded: it does not fit even after every evictable universe is gone
            (nothing is deleted or written then).
    """
    uid = spec.universe_id
    if find_manifest(ctx, uid) is not None or _build_running(ctx, uid):
        return None
    key = key or job_owner.get()
    projection = project_universe(ctx, spec)
    storage = universe_storage(ctx)
    budget = storage.budget
    if budget <= 0:
        return projection
    now = datetime.now(timezone.utc)
    if key is not None:
        _check_share(spec, projection, storage, key, now)
    held = storage.held(excluding=uid)
    chosen = _eviction_plan(storage, uid, key, held + projection.total - budget, projection.total, now)
    freed = sum(u.held for u in chosen)
    if held - freed + projection.total > budget:
        record_universe_refusal()
        numbers = {"projected_bytes": projection.total, "budget_bytes": budget, "held_bytes": held, "evictable_bytes": freed}
        raise UniverseBudgetExceeded(_refusal(spec, projection, storage, held, freed), numbers=numbers)
    for candidate in chosen:
        evict_universe(ctx, candidate.universe_id, reason="room")
    return projection


def _check_share(spec: UniverseSpec, projection: Projection, storage: UniverseStorage, key: str, now: datetime) -> None:
    """Refuse a build that would take ``key``'s charge past its share of the budget."""
    overrun = share_overrun(storage, key, projection.total, now, excluding=spec.universe_id)
    if overrun is None:
        return
    record_universe_refusal()
    mine, limit = overrun.charged, overrun.limit
    detail = (
        f"universe {spec.universe_id} of model {spec.model_id} would store about {size_words(projection.total)}, but "
        f"the {overrun.universes} universe(s) that API key {key} used within ENGRAM_UNIVERSE_RETENTION_S="
        f"{storage.retention_s:g}s (built, requested, or a variant requested from them; one that other keys use too "
        f"counts in full) hold {size_words(mine)}, and ENGRAM_UNIVERSE_KEY_SHARE={storage.share:g} of the "
        f"{size_words(storage.budget)} budget lets one key keep {size_words(limit)} alive. Nothing was built or "
        f'changed. Use a universe that exists (GET /models/{spec.model_id}/universes, "universe" on the request), '
        "build one of fewer concepts, wait until your universes fall out of use, or ask an admin to delete some "
        "(DELETE /universes/{id}) or to raise ENGRAM_UNIVERSE_KEY_SHARE"
    )
    numbers: dict[str, int | str] = {"key": key, "projected_bytes": projection.total, "budget_bytes": storage.budget}
    raise UniverseShareExceeded(detail, numbers={**numbers, "key_bytes": mine, "share_bytes": limit})


def _eviction_plan(
    storage: UniverseStorage, uid: str, key: str | None, need: int, projected: int, now: datetime
) -> list[StoredUniverse]:
    """What to evict to free ``need`` bytes: unused universes, least recently used first; then, for
    a request of ``key``, universes only other keys keep alive (:func:`service.universes.shares.displaceable`)."""
    chosen: list[StoredUniverse] = []
    freed = 0
    for candidate in storage.evictable(now, excluding=uid):
        if freed >= need:
            return chosen
        chosen.append(candidate)
        freed += candidate.held
    if key is None or freed >= need:
        return chosen
    return chosen + displaceable(storage, key, need - freed, projected, now, excluding=uid)


def _build_running(ctx: Context, universe_id: str) -> bool:
    request = find_request(ctx, universe_id)
    job = ctx.jobs.get(request.job_id) if request and request.job_id else None
    return job is not None and job.status not in FINISHED


def _refusal(spec: UniverseSpec, projection: Projection, storage: UniverseStorage, held: int, freed: int) -> str:
    others = [u for u in storage.universes if u.universe_id != spec.universe_id and u.held]
    in_use = held - freed
    assumed = (
        f" ({projection.assumed_float64} layer(s) counted as float64: their checkpoint is not on this machine)"
        if projection.assumed_float64
        else ""
    )
    sizes = f"factors {size_words(projection.groups)}, engrams {size_words(projection.engrams)}"
    return (
        f"universe {spec.universe_id} of model {spec.model_id} ({len(spec.prefixes)} member(s)) would store about "
        f"{size_words(projection.total)} ({sizes}){assumed}, but {_budget_words(storage)}, {len(others)} other "
        f"universe(s) hold {size_words(held)}, and {size_words(in_use)} of that is in use (a model's current universe, "
        f"a build or a variant job running, or used within ENGRAM_UNIVERSE_RETENTION_S={storage.retention_s:g}s by "
        "your key or by keys charged no more than yours): evicting every evictable universe would free only "
        f"{size_words(freed)}. Nothing was built or changed. Use a universe that exists "
        f'(GET /models/{spec.model_id}/universes, "universe" on the request), build one of fewer concepts, wait until '
        "universes fall out of use, or raise ENGRAM_UNIVERSE_BYTES_BUDGET"
    )


def _budget_words(storage: UniverseStorage) -> str:
    """The budget in force, and where it comes from when the volume capped it."""
    limits = storage.limits
    if limits is not None and limits.bytes != limits.configured:
        return (
            f"the universe budget is {size_words(storage.budget)} (ENGRAM_UNIVERSE_BYTES_BUDGET capped to "
            f"ENGRAM_UNIVERSE_VOLUME_FRACTION of the store's volume)"
        )
    return f"ENGRAM_UNIVERSE_BYTES_BUDGET is {size_words(storage.budget)}"


# ---------------------------------------------------------------- eviction


def evict_universe(ctx: Context, universe_id: str, *, reason: str) -> int:
    """Delete a universe's stored parts (call under ``ctx.lock``, after checking it is evictable).

    The manifest goes first, so from then on the universe is not built and anything that needs it
    builds it again; then everything else under its prefix (plan, groups, engrams, the build's part
    records) but ``request.json`` and ``usage.json`` (see the module docstring).

    Returns:
        The bytes it stored.
    """
    prefix = universe_prefix(universe_id)
    manifest = find_manifest(ctx, universe_id)
    groups, engrams = stored_parts(ctx, universe_id)
    freed = groups + engrams
    ctx.storage.delete(prefix + "manifest.json")
    ctx.reads.forget(prefix + "manifest.json")
    for stage in ctx.storage.list(prefix + "stages/"):  # a partial universe's stages, as its manifest: first
        ctx.storage.delete(stage)
    kept = {universe_request_key(universe_id), usage_key(universe_id)}
    parts = [k for k in ctx.storage.list(prefix) if k not in kept]  # plan, groups, engrams, part records
    for key in parts:
        ctx.storage.delete(key)
    _drop_local_copies(ctx, parts)
    usage = find_usage(ctx, universe_id)
    usage.update(evicted_at=utc_now(), evicted_bytes=freed)
    ctx.storage.put_json(usage_key(universe_id), usage)
    ctx.reads.forget(usage_key(universe_id))
    record_universe_eviction(reason)
    members = len(manifest.members) if manifest else None
    log.info("evicted universe %s (%s, %d bytes, %s members)", universe_id, reason, freed, members)
    return freed


def remove_universe(ctx: Context, universe_id: str) -> int:
    """Delete every stored object of a universe (``DELETE /universes/{id}``; call under ``ctx.lock``,
    after checking that no job and no model needs it).

    The manifest goes first (the universe stops existing at once), then its parts, its markers under
    every model ID that used it and its usage record; its request last, so that a delete interrupted
    half-way still finds the universe and can be repeated.

    Returns:
        The bytes of factors and engrams it stored.
    """
    prefix = universe_prefix(universe_id)
    groups, engrams = stored_parts(ctx, universe_id)
    request, usage = universe_request_key(universe_id), usage_key(universe_id)
    ctx.storage.delete(prefix + "manifest.json")
    ctx.reads.forget(prefix + "manifest.json")
    for stage in ctx.storage.list(prefix + "stages/"):  # a partial universe's stages, as its manifest: first
        ctx.storage.delete(stage)
    parts = [k for k in ctx.storage.list(prefix) if k not in {request, usage}]
    for key in parts:
        ctx.storage.delete(key)
    _drop_local_copies(ctx, parts)
    for marker in [k for k in ctx.storage.list(MODEL_UNIVERSES) if k.endswith(f"/known/{universe_id}")]:
        ctx.storage.delete(marker)
    for key in (usage, request):
        ctx.storage.delete(key)
        ctx.reads.forget(key)
    record_universe_eviction("deleted")
    log.info("deleted universe %s (%d bytes)", universe_id, groups + engrams)
    return groups + engrams


def _drop_local_copies(ctx: Context, keys: Sequence[str]) -> None:
    """Remove this machine's downloaded copies of deleted parts (service.storage.local_copies' names), so
    a rebuild is read from storage, not from a copy of the parts it replaced."""
    folder = ctx.cache_dir / "universes"
    for key in keys:
        (folder / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.safetensors").unlink(missing_ok=True)


def expire_unused(ctx: Context) -> list[str]:
    """The retention rule's periodic pass: evict every universe nobody uses (LRU first).

    Takes ``ctx.lock`` itself; the janitor calls it every ``ENGRAM_JANITOR_INTERVAL_S``.
    """
    with ctx.lock:
        evicted = [u.universe_id for u in universe_storage(ctx).evictable()]
        for uid in evicted:
            evict_universe(ctx, uid, reason="expired")
    return evicted


# ---------------------------------------------------------------- views and metrics


def storage_summary(ctx: Context, model_id: str | None = None) -> UniverseUsage:
    """``GET /universes/usage``: bytes of every universe (or one model's), the budget, statuses."""
    ids = model_universe_ids(ctx, model_id) if model_id is not None else None
    return usage_summary(universe_storage(ctx, ids), model_id)


def usage_summary(storage: UniverseStorage, model_id: str | None = None) -> UniverseUsage:
    """What ``GET /universes/usage`` shows (``model_id``: the model these universes are of) and
    ``/metrics`` exports: bytes, statuses, and each key's charge."""
    universes = storage.universes
    groups = sum(u.groups for u in universes)
    engrams = sum(u.engrams for u in universes)
    statuses: dict[str, int] = dict.fromkeys(("ready", "building", "partial", "failed", "evicted"), 0)
    for u in universes:
        statuses[u.status] += 1
    limits = storage.limits or Budget(storage.budget, storage.budget)
    held = key_holdings(storage, datetime.now(timezone.utc))
    keys = [
        UniverseKeyUsage(key=key, bytes=sum(u.held for u in kept), universes=len(kept)) for key, kept in sorted(held.items())
    ]
    return UniverseUsage(
        model_id=model_id,
        budget_bytes=storage.budget,
        configured_budget_bytes=limits.configured,
        volume_bytes=limits.volume,
        budget_note=limits.note,
        retention_s=storage.retention_s,
        key_share=storage.share,
        key_share_bytes=storage.share_bytes,
        bytes=UniverseBytes(groups=groups, engrams=engrams, total=groups + engrams),
        reserved_bytes=sum(u.reserved for u in universes),
        evictable_bytes=sum(u.stored for u in storage.evictable()),
        universes=UniverseStatusCounts(**statuses),
        keys=keys,
    )


def refresh_metrics(ctx: Context) -> None:
    """Set the universe gauges from storage (at scrape time: right whichever process built or
    evicted what); a storage error leaves the last values and never hides the other metrics."""
    try:
        summary = usage_summary(universe_storage(ctx))
    except Exception as exc:  # /metrics must answer while storage is away
        log.warning("universe metrics not refreshed: %s", exc)
        return
    set_universe_gauges(
        groups=summary.bytes.groups,
        engrams=summary.bytes.engrams,
        reserved=summary.reserved_bytes,
        budget=summary.budget_bytes,
        statuses=summary.universes.model_dump(),
    )
