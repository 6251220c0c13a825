"""The audit log: every state-changing request and its outcome, in the store and in the logs.

What is recorded (:class:`api_schemas.audit.AuditEntry`): the key's fingerprint and scope, the method,
the route template and the path's parameters, the names (never the values) of the query parameters,
the resource IDs the answer named, the status, the request ID and the time. What never is: a key,
any header, a query value (a callback URL's token would be one), a request body (records, datasets,
callback URLs) or a response body beyond its top-level ``*_id`` fields.

Why a pure ASGI middleware, placed outside auth and the body-size limit but inside the request ID:
it sees every answer those give (a 401, a 403, a 413, a 415, a 422 from validation, a 409, a 500 from
a crash) and the request ID they are logged with; a FastAPI dependency would miss all of those.

Where: one small immutable object per request, ``audit/<date>/<time>-<request id>-<nonce>.json``
(:func:`service.storage.keys.audit_key`), written with the storage's atomic put. The log is
append-only by construction (nothing here rewrites or deletes an object; only the retention rule,
``ENGRAM_AUDIT_RETENTION_DAYS``, off by default, deletes entries past their age:
:mod:`service.storage.audit_retention`), works alike on file:// and s3://, and a crash loses at
most the entry of the request it interrupted, never another entry.
The entry is written before the response's last body chunk is sent, so a client that got its
answer finds the entry (the answer waits at most ``_STORE_WAIT_S`` for it). A store that cannot
take it (S3 down) does not fail the request: the entry still goes to the ``engram.audit`` logger
(each entry is logged as one JSON line, for a SIEM), and an error naming the request says it is
missing from the store.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_schemas.audit import AuditEntry
from service.api.auth import ANONYMOUS
from service.observability import REQUEST_ID
from service.storage.base import Storage
from service.storage.keys import AUDIT, audit_day_prefix, audit_key

log = logging.getLogger("engram.audit")

AUDITED_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAX_CAPTURED = 64 * 1024  # answers naming IDs are small; a larger body is not read for IDs
_JSON_TYPES = (b"application/json", b"application/problem+json")
# How long an answer waits for its entry to be stored: a local put takes well under a millisecond and
# an S3 PUT tens of them; storage that is down (its client retrying with timeouts) must not hold
# every write request's answer for as long, so past this the answer goes and the put carries on.
_STORE_WAIT_S = 2.0


def key_safe(request_id: str) -> str:
    """The request ID as it may appear in a storage key: itself when it is plain, else a digest of it
    (a client chooses X-Request-ID, and a ``/`` or ``..`` in it must not become a key's path)."""
    if _SAFE_ID.fullmatch(request_id) and request_id not in (".", ".."):
        return request_id
    return "h" + uuid.uuid5(uuid.NAMESPACE_URL, request_id).hex


@dataclass
class _Answer:
    """What the response said, gathered while it is sent."""

    status: int = 500
    json_body: bool = False
    body: bytearray | None = None
    location: str | None = None


class AuditLog:
    """ASGI middleware: one :class:`AuditEntry` per POST/PUT/PATCH/DELETE, whatever its outcome."""

    def __init__(self, app: ASGIApp, storage: Storage, auth_on: bool) -> None:
        self.app = app
        self.storage = storage
        # Without auth every caller is the one anonymous admin; with it, no principal means refused (401).
        self.nobody = None if auth_on else ANONYMOUS.key_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() not in AUDITED_METHODS:
            await self.app(scope, receive, send)
            return
        arrived, started = datetime.now(timezone.utc), time.perf_counter()
        answer, written = _Answer(body=bytearray()), False

        async def audited_send(message: Message) -> None:
            nonlocal written
            if message["type"] == "http.response.start":
                _read_start(answer, message)
            elif message["type"] == "http.response.body":
                _capture(answer, message.get("body", b""))
                if not message.get("more_body", False) and not written:
                    written = True
                    await self._record(scope, arrived, started, answer)
            await send(message)

        try:
            await self.app(scope, receive, audited_send)
        except BaseException:
            if not written:  # a crash: the server answers 500 after this (or the client went away)
                written = True
                await self._record(scope, arrived, started, _Answer(status=500))
            raise
        if not written:  # an answer without a body message (a client that disconnected)
            await self._record(scope, arrived, started, answer)

    async def _record(self, scope: Scope, arrived: datetime, started: float, answer: _Answer) -> None:
        try:
            entry = audit_entry(scope, arrived, answer, (time.perf_counter() - started) * 1000, self.nobody)
        except Exception:  # a request the log cannot describe still gets its answer; the error says which
            log.exception("no audit entry for %s %s (request %s)", scope["method"], scope.get("path"), REQUEST_ID.get())
            return
        line = entry.model_dump_json()
        log.info("%s", line)
        key = audit_key(arrived, key_safe(entry.request_id), uuid.uuid4().hex[:8])
        try:
            with anyio.move_on_after(_STORE_WAIT_S) as waited:
                await anyio.to_thread.run_sync(self.storage.put_bytes, key, line.encode(), abandon_on_cancel=True)
        except Exception as exc:  # the request's answer stands; the log line above still carries it
            log.error("audit entry of request %s not stored (%s): it is only in this log", entry.request_id, exc)
            return
        if waited.cancelled_caught:
            log.error(
                "audit entry of request %s not stored within %.0f s (storage slow or down): answered without it; "
                "the write goes on in the background, and this log has the entry",
                entry.request_id,
                _STORE_WAIT_S,
            )


def _read_start(answer: _Answer, message: Message) -> None:
    answer.status = message["status"]
    for name, value in message.get("headers", []):
        lowered = name.lower()
        if lowered == b"content-type":
            answer.json_body = value.split(b";")[0].strip() in _JSON_TYPES
        elif lowered == b"location":
            answer.location = value.decode("latin-1").split("?")[0]  # a query could carry a token: dropped


def _capture(answer: _Answer, chunk: bytes) -> None:
    if answer.body is None or not answer.json_body:
        return
    if len(answer.body) + len(chunk) > _MAX_CAPTURED:
        answer.body = None
        return
    answer.body.extend(chunk)


def audit_entry(scope: Scope, arrived: datetime, answer: _Answer, duration_ms: float, nobody: str | None) -> AuditEntry:
    """The entry of one request: what the scope and the answer say, nothing from the request's body.
    ``nobody``: the key named when auth admitted no principal."""
    principal = scope.get("state", {}).get("auth")
    body = _json_object(answer.body) if answer.json_body else {}
    resources = _resource_ids(body)
    if answer.location:
        resources["location"] = answer.location
    route = getattr(scope.get("route"), "path", None)
    query = sorted({part.split(b"=")[0].decode("latin-1") for part in scope.get("query_string", b"").split(b"&") if part})
    return AuditEntry(
        at=arrived,
        request_id=REQUEST_ID.get() or "",
        key=nobody if principal is None else str(principal.key_id),
        scope=getattr(principal, "scope", None),
        method=scope["method"].upper(),
        route=route,
        path=scope.get("path", ""),
        path_params={k: str(v) for k, v in (scope.get("path_params") or {}).items()},
        query=query,
        resources=resources,
        status=answer.status,
        problem=body.get("title") if answer.status >= 400 and isinstance(body.get("title"), str) else None,
        duration_ms=round(duration_ms, 3),
    )


def _json_object(raw: bytearray | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _resource_ids(body: dict[str, Any]) -> dict[str, str]:
    """The answer's top-level ``*_id`` strings, and those of its top-level objects (a submission's
    ``variant`` and ``job``), first seen wins."""
    found: dict[str, str] = {}
    for value in (body, *(v for v in body.values() if isinstance(v, dict))):
        for name, item in value.items():
            if name.endswith("_id") and isinstance(item, str) and name not in found:
                found[name] = item
    return found


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class AuditFilter:
    """What ``GET /audit`` keeps: every field set must match."""

    key: str | None = None
    method: str | None = None
    path_prefix: str | None = None
    status: int | None = None
    since: datetime | None = None
    until: datetime | None = None

    def matches(self, entry: AuditEntry) -> bool:
        return (
            (self.key is None or entry.key == self.key)
            and (self.method is None or entry.method == self.method.upper())
            and (self.path_prefix is None or entry.path.startswith(self.path_prefix))
            and (self.status is None or entry.status == self.status)
            and (self.since is None or entry.at >= self.since)
            and (self.until is None or entry.at < self.until)
        )


def audit_keys(storage: Storage, since: datetime | None, until: datetime | None) -> Iterator[str]:
    """The stored entries' keys, oldest first: one listing per day of a bounded range, else the whole log."""
    if since is None or until is None:
        yield from (k for k in storage.list(AUDIT) if k.endswith(".json"))
        return
    day, last = _utc(since).date(), _utc(until).date()
    while day <= last:
        yield from (k for k in storage.list(audit_day_prefix(day.isoformat())) if k.endswith(".json"))
        day = day + timedelta(days=1)


def read_entry(storage: Storage, key: str) -> AuditEntry | None:
    """The entry at ``key``; None (with an error in the log) when it cannot be read."""
    try:
        return AuditEntry.model_validate_json(storage.get_bytes(key))
    except Exception as exc:  # one damaged entry must not hide the rest of the log
        log.error("audit entry %s cannot be read: %s", key, exc)
        return None


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
