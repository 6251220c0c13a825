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
caller is one key, ``anonymous``, without auth). A universe whose only user within the retention age
is one key is *kept alive by that key*; its bytes count against that key's share,
``ENGRAM_UNIVERSE_KEY_SHARE`` × the budget: a request of that key that would take it past its share
is a 409 (:class:`UniverseShareExceeded`) naming the setting and the key's usage, whatever room the
budget has. When another key needs room and evicting unused universes is not enough, the universes
one other key alone keeps alive are evictable too (not a current universe, not one a job needs), the
heaviest key's least recently used first, and only from keys that hold more than the requesting key
will hold once its universe is built: a key can push out a heavier one, never a lighter one. A
universe used by two keys within the retention age counts against neither and is never evicted
early.

Volume. For ``file://`` storage the budget is capped at ``ENGRAM_UNIVERSE_VOLUME_FRACTION`` of the
store's volume (used + free bytes, :func:`effective_budget`), as the configured budget may exceed the
disk; the cap is logged once per process (at start-up: the janitor's first pass) and shown by
``GET /universes/usage``. S3 has no volume: nothing is checked there, and the usage says so.

Usage record: ``universes/<id>/usage.json`` ``{last_used, users, projected, evicted_at,
evicted_bytes}``, the only mutable part of a universe besides its request's ``job_id``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from api_schemas.universes import UniverseBytes, UniverseKeyUsage, UniverseStatusCounts, UniverseUsage
from service.context import Context
from service.errors import Conflict, ProblemDetails
from service.jobs.admission import job_owner
from service.jobs.records import UniversePayload, VariantPayload
from service.jobs.store import FINISHED, utc_now
from service.observability import record_universe_eviction, record_universe_refusal, set_universe_gauges
from service.storage.keys import (
    MODEL_UNIVERSES,
    universe_prefix,
    universe_request_key,
    usage_key,
    variant_request_key,
)
from service.storage.local import LocalStorage
from service.universes.projection import Projection, project_universe
from service.universes.records import (
    current_universe_ids,
    find_manifest,
    find_request,
    find_usage,
    known_universe_ids,
    model_universe_ids,
)
from service.universes.spec import UniverseSpec

log = logging.getLogger("engram.universes")

# A use is written at most this often per universe: a burst of variant requests costs one write.
_USE_WRITE_INTERVAL_S = 60.0

Status = Literal["ready", "building", "partial", "failed", "evicted"]


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
    ``key``, ``key_bytes`` (what the universes it alone keeps alive hold) and ``share_bytes``.
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
    users = _users(usage)
    changed = projected is not None or (rebuilding and usage.get("evicted_at") is not None)
    changed = changed or (key is not None and _stale(users.get(key), now))
    if not changed and not _stale(_parse_time(usage.get("last_used")), now):
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


def _users(usage: Mapping[str, Any]) -> dict[str, datetime]:
    """The usage record's ``users`` (key identity → last use) as times; unreadable entries dropped."""
    found = {str(k): _parse_time(v) for k, v in dict(usage.get("users") or {}).items()}
    return {k: t for k, t in found.items() if t is not None}


def mark_built(ctx: Context, universe_id: str) -> None:
    """The build job's hook at its end (after ``manifest.json``): the universe was just used."""
    note_use(ctx, universe_id, rebuilding=True)


# ---------------------------------------------------------------- what is stored


@dataclass(frozen=True)
class StoredUniverse:
    """One universe's share of storage.

    Attributes:
        groups, engrams: bytes stored now (from the manifest once ready; the parts stored so far
            while building or after a failed build; 0 once evicted).
        reserved: bytes an unfinished build is projected to add beyond what it stored so far.
        last_used: when it was last used (its request's time for universes without a usage record).
        current: the current universe of some model.
        busy: a job not finished yet builds it or reads it.
        users: the API keys whose requests used it, and when each last did.
    """

    universe_id: str
    status: Status
    groups: int
    engrams: int
    reserved: int
    last_used: datetime
    current: bool
    busy: bool
    users: Mapping[str, datetime] = field(default_factory=dict)

    @property
    def stored(self) -> int:
        return self.groups + self.engrams

    @property
    def held(self) -> int:
        """What it counts against the budget: stored, plus what a running build will add."""
        return self.stored + self.reserved

    def evictable(self, now: datetime, retention_s: float) -> bool:
        """Nobody uses it (see the module docstring) and it holds bytes to free."""
        idle = (now - self.last_used).total_seconds() >= retention_s
        return idle and not self.current and not self.busy and self.stored > 0

    def keeper(self, now: datetime, retention_s: float) -> str | None:
        """The one API key that keeps it alive: the only one that used it within the retention age."""
        live = [k for k, t in self.users.items() if (now - t).total_seconds() < retention_s]
        return live[0] if len(live) == 1 else None

    def evictable_for(self, key: str, now: datetime, retention_s: float) -> bool:
        """Another key alone keeps it alive, and no model or job needs it: it may make room for ``key``."""
        keeper = self.keeper(now, retention_s)
        return keeper is not None and keeper != key and not self.current and not self.busy and self.stored > 0


@dataclass(frozen=True)
class Budget:
    """The universe budget in force.

    Attributes:
        bytes: what the rule enforces (0: no limit): the configured budget, capped to the volume.
        configured: ``ENGRAM_UNIVERSE_BYTES_BUDGET``.
        volume: the bytes of the volume holding a ``file://`` store (used + free); None elsewhere.
        note: why ``bytes`` differs from ``configured``, or what was not checked (None: nothing to say).
    """

    bytes: int
    configured: int
    volume: int | None = None
    note: str | None = None


_logged: set[tuple[str, int, int]] = set()  # (store, configured, in force) already logged by this process


def _log_once(ctx: Context, budget: Budget, level: int, message: str) -> None:
    """Say what the budget in force is once per process and budget (the janitor's pass at start-up
    is the first to ask), not on every request."""
    marker = (repr(ctx.storage), budget.configured, budget.bytes)
    if marker not in _logged:
        _logged.add(marker)
        log.log(level, message)


def effective_budget(ctx: Context) -> Budget:
    """``ENGRAM_UNIVERSE_BYTES_BUDGET``, for ``file://`` storage capped at
    ``ENGRAM_UNIVERSE_VOLUME_FRACTION`` of the store's volume (used + free bytes, a statfs: cheap
    enough to read on every request, so a resized volume counts at once). A cap is logged once per
    process. S3 has no volume: the configured budget is used as it is, and the note says so.
    """
    settings = ctx.settings
    configured = settings.universe_bytes_budget
    if not isinstance(ctx.storage, LocalStorage):
        note = "object storage (s3): no volume to check the budget against; ENGRAM_UNIVERSE_BYTES_BUDGET applies as set"
        budget = Budget(configured, configured, None, note)
        _log_once(ctx, budget, logging.INFO, note)
        return budget
    try:
        disk = shutil.disk_usage(ctx.storage.root)
    except OSError as exc:  # the store is away: storage errors say so elsewhere; keep the configured budget
        return Budget(configured, configured, None, f"the store's volume could not be measured ({exc})")
    volume = disk.used + disk.free
    cap = int(volume * settings.universe_volume_fraction)
    if configured <= 0 or configured <= cap:
        return Budget(configured, configured, volume)
    note = (
        f"ENGRAM_UNIVERSE_BYTES_BUDGET={_size(configured)} exceeds ENGRAM_UNIVERSE_VOLUME_FRACTION="
        f"{settings.universe_volume_fraction:g} of the volume holding {ctx.storage.root} ({_size(volume)}): "
        f"the budget in force is {_size(cap)}"
    )
    budget = Budget(cap, configured, volume, note)
    _log_once(ctx, budget, logging.WARNING, f"{note}; lower ENGRAM_UNIVERSE_BYTES_BUDGET, or give the store a larger volume")
    return budget


@dataclass(frozen=True)
class UniverseStorage:
    """Every universe's share of storage, and the budget."""

    universes: list[StoredUniverse]
    budget: int
    retention_s: float
    limits: Budget | None = None
    share: float = 1.0

    def held(self, excluding: str | None = None) -> int:
        return sum(u.held for u in self.universes if u.universe_id != excluding)

    def evictable(self, now: datetime | None = None, excluding: str | None = None) -> list[StoredUniverse]:
        """Evictable universes, least recently used first."""
        moment = now or datetime.now(timezone.utc)
        found = [u for u in self.universes if u.universe_id != excluding and u.evictable(moment, self.retention_s)]
        return sorted(found, key=lambda u: (u.last_used, u.universe_id))

    @property
    def share_bytes(self) -> int:
        """What the universes one key alone keeps alive may hold (the budget when shares are off)."""
        return int(self.budget * self.share)

    def by_key(self, now: datetime | None = None, excluding: str | None = None) -> dict[str, list[StoredUniverse]]:
        """Key identity → the universes holding bytes that it alone keeps alive (least recently used first)."""
        moment = now or datetime.now(timezone.utc)
        kept: dict[str, list[StoredUniverse]] = {}
        for u in sorted(self.universes, key=lambda u: (u.last_used, u.universe_id)):
            keeper = u.keeper(moment, self.retention_s)
            if keeper is not None and u.held > 0 and u.universe_id != excluding:  # an evicted one holds nothing
                kept.setdefault(keeper, []).append(u)
        return kept

    def key_bytes(self, key: str, now: datetime | None = None, excluding: str | None = None) -> int:
        """What the universes ``key`` alone keeps alive hold (stored and reserved)."""
        return sum(u.held for u in self.by_key(now, excluding).get(key, []))

    def summary(self, model_id: str | None = None) -> UniverseUsage:
        """What ``GET /universes/usage`` shows (``model_id``: the model these universes are of) and
        ``/metrics`` exports."""
        groups = sum(u.groups for u in self.universes)
        engrams = sum(u.engrams for u in self.universes)
        statuses: dict[str, int] = dict.fromkeys(("ready", "building", "partial", "failed", "evicted"), 0)
        for u in self.universes:
            statuses[u.status] += 1
        limits = self.limits or Budget(self.budget, self.budget)
        keys = [
            UniverseKeyUsage(key=key, bytes=sum(u.held for u in kept), universes=len(kept))
            for key, kept in sorted(self.by_key().items())
        ]
        return UniverseUsage(
            model_id=model_id,
            budget_bytes=self.budget,
            configured_budget_bytes=limits.configured,
            volume_bytes=limits.volume,
            budget_note=limits.note,
            retention_s=self.retention_s,
            key_share=self.share,
            key_share_bytes=self.share_bytes,
            bytes=UniverseBytes(groups=groups, engrams=engrams, total=groups + engrams),
            reserved_bytes=sum(u.reserved for u in self.universes),
            evictable_bytes=sum(u.stored for u in self.evictable()),
            universes=UniverseStatusCounts(**statuses),
            keys=keys,
        )


def universe_storage(ctx: Context, universe_ids: Iterable[str] | None = None) -> UniverseStorage:
    """What every known universe (or those of ``universe_ids``) holds now, read from storage."""
    ids = sorted(set(universe_ids) if universe_ids is not None else known_universe_ids(ctx))
    current = current_universe_ids(ctx)
    busy = busy_universes(ctx)
    settings = ctx.settings
    found = [u for uid in ids if (u := stored_universe(ctx, uid, current=uid in current, busy=uid in busy))]
    limits = effective_budget(ctx)
    return UniverseStorage(found, limits.bytes, settings.universe_retention_s, limits, settings.key_share)


def stored_universe(ctx: Context, universe_id: str, *, current: bool, busy: bool) -> StoredUniverse | None:
    """One universe's share of storage (None when it was never requested)."""
    request = find_request(ctx, universe_id)
    if request is None:
        return None
    usage = find_usage(ctx, universe_id)
    last_used = _parse_time(usage.get("last_used")) or _parse_time(request.created_at) or datetime.now(timezone.utc)
    users = _users(usage)
    manifest = find_manifest(ctx, universe_id)
    job = ctx.jobs.get(request.job_id) if request.job_id else None
    building = busy or (job is not None and job.status not in FINISHED)
    if manifest is not None:
        g, e = manifest.bytes.groups, manifest.bytes.engrams
        return StoredUniverse(universe_id, "ready", g, e, 0, last_used, current, building, users)
    groups, engrams = _stored_parts(ctx, universe_id)
    if building:
        projected = int((usage.get("projected") or {}).get("total", 0))
        reserved = max(0, projected - groups - engrams)
        return StoredUniverse(universe_id, "building", groups, engrams, reserved, last_used, current, True, users)
    status: Status = "evicted" if usage.get("evicted_at") and groups + engrams == 0 else "failed"
    if status == "failed" and ctx.storage.list(universe_prefix(universe_id) + "stages/"):
        status = "partial"  # the groups requests needed are built; the others wait for a request that needs them
    return StoredUniverse(universe_id, status, groups, engrams, 0, last_used, current, False, users)


def _stored_parts(ctx: Context, universe_id: str) -> tuple[int, int]:
    """Bytes of the groups and engram files stored so far (a build running, or one that failed)."""
    prefix = universe_prefix(universe_id)
    groups = sum(ctx.storage.size(k) for k in ctx.storage.list(prefix + "groups/"))
    engrams = sum(ctx.storage.size(k) for k in ctx.storage.list(prefix + "engrams/") if k.endswith(".safetensors"))
    return groups, engrams


def busy_universes(ctx: Context) -> set[str]:
    """Universes that an unfinished job builds or reads: ``universe`` jobs and ``variant`` jobs."""
    return set(busy_jobs(ctx))


def busy_jobs(ctx: Context) -> dict[str, list[str]]:
    """Universe ID → the unfinished ``universe`` and ``variant`` jobs that build or read it."""
    busy: dict[str, list[str]] = {}
    for job in ctx.jobs.active():
        payload = job.payload
        uid = None
        if isinstance(payload, UniversePayload):
            uid = payload.universe_id
        elif isinstance(payload, VariantPayload):
            uid = (ctx.storage.find_json(variant_request_key(payload.variant_id)) or {}).get("universe_id")
        if uid:
            busy.setdefault(uid, []).append(job.job_id)
    return busy


# ---------------------------------------------------------------- budget


def make_room(ctx: Context, spec: UniverseSpec, key: str | None = None) -> Projection | None:
    """Check that a new build of ``spec`` fits the budget and ``key``'s share of it, evicting unused
    universes (and, for ``key``, those one heavier key alone keeps alive) if it must; call under
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
    """Refuse a build that would take ``key``'s universes past its share of the budget."""
    if storage.share >= 1:
        return
    mine = storage.key_bytes(key, now, excluding=spec.universe_id)
    limit = storage.share_bytes
    if mine + projection.total <= limit:
        return
    record_universe_refusal()
    count = len(storage.by_key(now, excluding=spec.universe_id).get(key, []))
    detail = (
        f"universe {spec.universe_id} of model {spec.model_id} would store about {_size(projection.total)}, but the "
        f"{count} universe(s) that API key {key} alone used within ENGRAM_UNIVERSE_RETENTION_S="
        f"{storage.retention_s:g}s hold {_size(mine)}, and ENGRAM_UNIVERSE_KEY_SHARE={storage.share:g} of the "
        f"{_size(storage.budget)} budget lets one key keep {_size(limit)} alive. Nothing was built or changed. Use a "
        f'universe that exists (GET /models/{spec.model_id}/universes, "universe" on the request), build one of fewer '
        "concepts, wait until your universes fall out of use, or ask an admin to delete some (DELETE /universes/{id}) "
        "or to raise ENGRAM_UNIVERSE_KEY_SHARE"
    )
    numbers: dict[str, int | str] = {"key": key, "projected_bytes": projection.total, "budget_bytes": storage.budget}
    raise UniverseShareExceeded(detail, numbers={**numbers, "key_bytes": mine, "share_bytes": limit})


def _eviction_plan(
    storage: UniverseStorage, uid: str, key: str | None, need: int, projected: int, now: datetime
) -> list[StoredUniverse]:
    """What to evict to free ``need`` bytes: unused universes, least recently used first; then, for
    a request of ``key``, universes one other key alone keeps alive, from the key holding the most,
    while it holds more than ``key`` will once its universe (``projected`` bytes) is built."""
    chosen: list[StoredUniverse] = []
    freed = 0
    for candidate in storage.evictable(now, excluding=uid):
        if freed >= need:
            return chosen
        chosen.append(candidate)
        freed += candidate.held
    if key is None or freed >= need:
        return chosen
    kept = storage.by_key(now, excluding=uid)
    totals = {k: sum(u.held for u in found) for k, found in kept.items()}
    mine = totals.get(key, 0) + projected
    candidates = {
        k: [u for u in found if u.evictable_for(key, now, storage.retention_s)] for k, found in kept.items() if k != key
    }
    while freed < need:
        heavy = [k for k, found in candidates.items() if found and totals[k] > mine]
        if not heavy:
            break
        victim = max(heavy, key=lambda k: (totals[k], k))
        candidate = candidates[victim].pop(0)
        chosen.append(candidate)
        freed += candidate.held
        totals[victim] -= candidate.held
    return chosen


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
    return (
        f"universe {spec.universe_id} of model {spec.model_id} ({len(spec.prefixes)} member(s)) would store about "
        f"{_size(projection.total)} (factors {_size(projection.groups)}, engrams {_size(projection.engrams)}){assumed}, "
        f"but {_budget_words(storage)}, {len(others)} other universe(s) hold "
        f"{_size(held)}, and {_size(in_use)} of that is in use (a model's current universe, a build or a variant job "
        f"running, or used within ENGRAM_UNIVERSE_RETENTION_S={storage.retention_s:g}s by several API keys or by a key "
        f"holding no more than yours): evicting every evictable universe would free only {_size(freed)}. Nothing was "
        "built or changed. Use a universe that exists "
        f'(GET /models/{spec.model_id}/universes, "universe" on the request), build one of fewer concepts, wait until '
        "universes fall out of use, or raise ENGRAM_UNIVERSE_BYTES_BUDGET"
    )


def _budget_words(storage: UniverseStorage) -> str:
    """The budget in force, and where it comes from when the volume capped it."""
    limits = storage.limits
    if limits is not None and limits.bytes != limits.configured:
        return (
            f"the universe budget is {_size(storage.budget)} (ENGRAM_UNIVERSE_BYTES_BUDGET capped to "
            f"ENGRAM_UNIVERSE_VOLUME_FRACTION of the store's volume)"
        )
    return f"ENGRAM_UNIVERSE_BYTES_BUDGET is {_size(storage.budget)}"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


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
    groups, engrams = _stored_parts(ctx, universe_id)
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
    groups, engrams = _stored_parts(ctx, universe_id)
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
    return universe_storage(ctx, ids).summary(model_id)


def refresh_metrics(ctx: Context) -> None:
    """Set the universe gauges from storage (at scrape time: right whichever process built or
    evicted what); a storage error leaves the last values and never hides the other metrics."""
    try:
        summary = universe_storage(ctx).summary()
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


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)
