"""The audit log's retention: entries older than ``ENGRAM_AUDIT_RETENTION_DAYS`` are deleted. Off by default.

Applied as the universes' and the variants' retention rules are: by each API process's janitor, at
start-up and every ``ENGRAM_JANITOR_INTERVAL_S`` (one of :data:`service.execution.kinds.DUTIES`).
An entry's time is read from its key alone (``audit/<date>/<HHMMSS.ffffff>Z-...``,
:func:`service.storage.keys.audit_key`: the arrival time in UTC, fixed width), so no entry is read
to decide, and a damaged entry ages out like any other: one listing of the log (bounded by the
retention window) per pass. Two API processes running the pass at once delete the same keys: a
delete of a key already gone is not an error.

Nothing else rewrites or deletes an entry (:mod:`service.api.audit`): with retention set, the log is
append-only within the window.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Protocol

from service.config import Settings
from service.storage.base import Storage
from service.storage.keys import AUDIT

log = logging.getLogger("engram.audit")


class _Held(Protocol):
    """What the pass reads of a process's context."""

    @property
    def storage(self) -> Storage: ...

    @property
    def settings(self) -> Settings: ...


def expire_audit(ctx: _Held, now: datetime | None = None) -> list[str]:
    """Delete the audit entries older than the retention age (none when it is 0); the keys deleted."""
    days = ctx.settings.audit_retention_days
    if days <= 0:
        return []
    cut = (now or datetime.now(timezone.utc)) - timedelta(days=days)
    expired = [key for key in ctx.storage.list(AUDIT) if _expired(key, cut)]
    for key in expired:
        ctx.storage.delete(key)
    if expired:
        log.info(
            "audit retention deleted %d entries older than %s (ENGRAM_AUDIT_RETENTION_DAYS=%g)", len(expired), cut, days
        )
    return expired


def entry_time(key: str) -> datetime | None:
    """The arrival time a stored entry's key names; None for a key of another shape (left alone)."""
    parts = key.removeprefix(AUDIT).split("/")
    if len(parts) != 2 or len(parts[1]) < 14:
        return None
    try:
        return datetime.strptime(f"{parts[0]} {parts[1][:13]}", "%Y-%m-%d %H%M%S.%f").replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def _expired(key: str, cut: datetime) -> bool:
    at = entry_time(key)
    return at is not None and at < cut
