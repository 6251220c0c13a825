"""What every universe holds in storage now, and the budget in force: read from storage, decided nowhere.

A universe's bytes (its manifest's once ready, the parts stored so far while building or after a
failed build, 0 once evicted, plus what an unfinished build is projected to add), its status,
whether a model's current pointer or an unfinished job needs it, when it was last used and which
API keys used it. :mod:`service.universes.retention` decides from this view what to evict and what
to refuse, :mod:`service.universes.shares` what each key is charged.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from service.context import Context
from service.jobs.records import UniversePayload, VariantPayload
from service.jobs.store import FINISHED
from service.storage.keys import universe_prefix, variant_request_key
from service.storage.local import LocalStorage
from service.universes.records import current_universe_ids, find_manifest, find_request, find_usage, known_universe_ids

log = logging.getLogger("engram.universes")

Status = Literal["ready", "building", "partial", "failed", "evicted"]


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
        """Nobody uses it (the retention rule: :mod:`service.universes.retention`) and it holds bytes to free."""
        idle = (now - self.last_used).total_seconds() >= retention_s
        return idle and not self.current and not self.busy and self.stored > 0

    def live_users(self, now: datetime, retention_s: float) -> frozenset[str]:
        """The API keys that used it within the retention age: each one keeps it alive, and is
        charged its bytes (:mod:`service.universes.shares`)."""
        return frozenset(k for k, t in self.users.items() if (now - t).total_seconds() < retention_s)

    def evictable_for(self, key: str, now: datetime, retention_s: float) -> bool:
        """Only other keys keep it alive, and no model or job needs it: it may make room for ``key``
        (which keys may be displaced, and in what order: :func:`service.universes.shares.displaceable`)."""
        users = self.live_users(now, retention_s)
        return bool(users) and key not in users and not self.current and not self.busy and self.stored > 0


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
        f"ENGRAM_UNIVERSE_BYTES_BUDGET={size_words(configured)} exceeds ENGRAM_UNIVERSE_VOLUME_FRACTION="
        f"{settings.universe_volume_fraction:g} of the volume holding {ctx.storage.root} ({size_words(volume)}): "
        f"the budget in force is {size_words(cap)}"
    )
    budget = Budget(cap, configured, volume, note)
    if "universe_bytes_budget" in settings.model_fields_set:  # the operator's own figure: worth a warning
        _log_once(
            ctx, budget, logging.WARNING, f"{note}; lower ENGRAM_UNIVERSE_BYTES_BUDGET, or give the store a larger volume"
        )
    else:  # the default capped to a small disk is the rule working, not a problem (issue 40: a warning no one set)
        _log_once(ctx, budget, logging.INFO, f"{note} (the default budget, capped to the volume: nothing to do)")
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
        """What the universes one key keeps alive may hold (the budget when shares are off)."""
        return int(self.budget * self.share)


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
    last_used = parse_time(usage.get("last_used")) or parse_time(request.created_at) or datetime.now(timezone.utc)
    users = read_users(usage)
    manifest = find_manifest(ctx, universe_id)
    job = ctx.jobs.get(request.job_id) if request.job_id else None
    building = busy or (job is not None and job.status not in FINISHED)
    if manifest is not None:
        g, e = manifest.bytes.groups, manifest.bytes.engrams
        return StoredUniverse(universe_id, "ready", g, e, 0, last_used, current, building, users)
    groups, engrams = stored_parts(ctx, universe_id)
    if building:
        projected = int((usage.get("projected") or {}).get("total", 0))
        reserved = max(0, projected - groups - engrams)
        return StoredUniverse(universe_id, "building", groups, engrams, reserved, last_used, current, True, users)
    status: Status = "evicted" if usage.get("evicted_at") and groups + engrams == 0 else "failed"
    if status == "failed" and ctx.storage.list(universe_prefix(universe_id) + "stages/"):
        status = "partial"  # the groups requests needed are built; the others wait for a request that needs them
    return StoredUniverse(universe_id, status, groups, engrams, 0, last_used, current, False, users)


def stored_parts(ctx: Context, universe_id: str) -> tuple[int, int]:
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


def read_users(usage: Mapping[str, Any]) -> dict[str, datetime]:
    """The usage record's ``users`` (key identity → last use) as times; unreadable entries dropped."""
    found = {str(k): parse_time(v) for k, v in dict(usage.get("users") or {}).items()}
    return {k: t for k, t in found.items() if t is not None}


def parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def size_words(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"
