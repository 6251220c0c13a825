"""Variants' retention: a byte budget and an age, least recently downloaded first. Off by default.

``ENGRAM_VARIANT_BYTES_BUDGET`` bounds the bytes of every ready variant's files together and
``ENGRAM_VARIANT_RETENTION_S`` the time since a variant was last downloaded (or created, when it
never was); 0, the default of both, means no bound, and then nothing here reads or writes anything,
so a deployment that sets neither runs as it did. Unlike a universe, a variant's size is known only
once it is built, so the budget is applied after each build (the new variant is never the one
evicted) and by the API's janitor every ``ENGRAM_JANITOR_INTERVAL_S``: the least recently downloaded
variants go first, only as many as needed.

Never evicted: a variant an unfinished job builds or reads (as :func:`~service.variants.deletion.jobs_using`),
or one downloaded within :data:`READING_S` (a checkpoint's files stream for minutes, and the API
cannot see another process's open downloads: a recent download is taken as one still being read).
Evicting a variant deletes what ``DELETE /variants/{id}`` deletes (:func:`~service.variants.deletion.owned_keys`):
its ID is a content hash, so the same request builds it again under the same ID.

Usage record: ``variants/<id>/usage.json`` ``{last_download}``, written at most once a minute per
variant (:data:`NOTE_EVERY_S`), and only while a bound is set.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from service.context import Context
from service.storage.keys import VARIANTS, variant_manifest_key
from service.variants.deletion import owned_keys
from service.variants.provenance import find_provenance

log = logging.getLogger("engram.variants")

READING_S = 600.0  # a download within this long counts as one still being read
NOTE_EVERY_S = 60.0  # a download is recorded at most this often per variant: one write, not one per file
_NEVER = datetime.min.replace(tzinfo=timezone.utc)


def usage_key(variant_id: str) -> str:
    return f"{VARIANTS}{variant_id}/usage.json"


def bounded(ctx: Context) -> bool:
    """Whether a budget or a retention age is set (else nothing here reads or writes)."""
    return ctx.settings.variant_bytes_budget > 0 or ctx.settings.variant_retention_s > 0


def note_download(ctx: Context, variant_id: str) -> None:
    """Record that the variant's files are being downloaded (throttled; nothing without a bound)."""
    if not bounded(ctx):
        return
    now = datetime.now(timezone.utc)
    if now - _last_download(ctx, variant_id, recent=True) < timedelta(seconds=NOTE_EVERY_S):
        return
    key = usage_key(variant_id)
    ctx.storage.put_json(key, {"last_download": now.isoformat()})
    ctx.reads.forget(key)


@dataclass(frozen=True)
class HeldVariant:
    variant_id: str
    size: int
    last_used: datetime
    protected: bool


def held_variants(ctx: Context, now: datetime) -> list[HeldVariant]:
    """Every ready variant, its bytes, when it was last downloaded (else created), and whether it
    may not be evicted, least recently used first."""
    ids = sorted({k.split("/")[1] for k in ctx.storage.list(VARIANTS) if k.endswith("/manifest.json")})
    payloads = [json.dumps(job.payload.model_dump(mode="json")) for job in ctx.jobs.unfinished()]
    busy = {vid for vid in ids if any(vid in payload for payload in payloads)}  # as jobs_using, read once
    held = []
    for vid in ids:
        manifest = ctx.storage.find_json(variant_manifest_key(vid)) or {}
        size = sum(int(f.get("size", 0)) for f in manifest.get("files", []))
        downloaded = _last_download(ctx, vid)
        record = find_provenance(ctx, vid)
        created = datetime.fromisoformat(record.created_at) if record is not None else _NEVER
        reading = now - downloaded < timedelta(seconds=READING_S)
        held.append(HeldVariant(vid, size, max(downloaded, created), vid in busy or reading))
    return sorted(held, key=lambda h: (h.last_used, h.variant_id))


def to_evict(held: list[HeldVariant], budget: int, retention_s: float, now: datetime, keep: str | None) -> list[str]:
    """The variants the rule evicts: every unprotected one older than the retention age, then the
    least recently used unprotected ones until the rest fits the budget (0: no bound)."""
    free = [h for h in held if not h.protected and h.variant_id != keep]
    expired = [h for h in free if retention_s > 0 and now - h.last_used > timedelta(seconds=retention_s)]
    chosen = {h.variant_id for h in expired}
    total = sum(h.size for h in held if h.variant_id not in chosen)
    for h in free:
        if budget <= 0 or total <= budget:
            break
        if h.variant_id not in chosen:
            chosen.add(h.variant_id)
            total -= h.size
    return [h.variant_id for h in held if h.variant_id in chosen]


def expire_variants(ctx: Context, keep: str | None = None) -> list[str]:
    """Apply the rule now (the janitor's periodic duty, and after each build with ``keep`` the new
    variant); what it deleted. Takes ``ctx.lock``."""
    if not bounded(ctx):
        return []
    with ctx.lock:
        now = datetime.now(timezone.utc)
        settings = ctx.settings
        evicted = to_evict(held_variants(ctx, now), settings.variant_bytes_budget, settings.variant_retention_s, now, keep)
        for vid in evicted:
            for key in owned_keys(ctx, vid):
                ctx.storage.delete(key)
                ctx.reads.forget(key)
    if evicted:
        log.info("variant retention evicted %d variant(s): %s", len(evicted), evicted)
    return evicted


def _last_download(ctx: Context, variant_id: str, *, recent: bool = False) -> datetime:
    key = usage_key(variant_id)
    stored = ctx.reads.recent_json(key) if recent else ctx.storage.find_json(key)
    found = stored.get("last_download") if isinstance(stored, dict) else None
    return datetime.fromisoformat(found) if isinstance(found, str) else _NEVER
