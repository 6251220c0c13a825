"""Completion callbacks: when a job ends, POST it to the URLs its submitter gave.

Delivery is at least once and survives restarts: when a job with callbacks reaches a final state,
an outbox entry per URL is written to storage (``callbacks/pending/``) *before* the job's open
marker is dropped; a dispatcher thread in every API process delivers due entries, deletes an entry
only after a 2xx answer, and retries the others with exponential backoff
(``ENGRAM_CALLBACK_BACKOFF_S`` doubling up to 10 minutes, ``ENGRAM_CALLBACK_MAX_ATTEMPTS``), after
which the entry moves to ``callbacks/failed/``. The receiver deduplicates by the ``webhook-id``
header, which is the job ID (the same for every retry).

Security: only hosts in ``ENGRAM_CALLBACK_HOSTS`` may be called (checked when the URL is submitted,
so a refused URL is a 422 that stores nothing, and again before every delivery), redirects are never
followed (a redirect could point anywhere), and every request is signed as Standard Webhooks
prescribe: ``webhook-signature: v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<body>")>``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from service.config import Settings
from service.errors import InvalidInput
from service.jobs.periodic import PeriodicDuty
from service.storage.base import ObjectNotFound, Storage
from service.storage.keys import FAILED_CALLBACKS, PENDING_CALLBACKS

log = logging.getLogger("engram.callbacks")
MAX_BACKOFF_S = 600.0
EVENT = "job.finished"


# ---------------------------------------------------------------- what may be called


def check_callback_url(url: str, settings: Settings) -> str:
    """The URL, if callbacks may reach it; otherwise an :class:`InvalidInput` (422) saying why.

    Args:
        url: what the user sent as ``callback_url``.
        settings: carries the allowlist ``ENGRAM_CALLBACK_HOSTS``.

    Returns:
        ``url`` unchanged.
    """
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise InvalidInput(f"callback_url must be an absolute http(s) URL, got {url!r}")
    if parts.username is not None or parts.password is not None:
        raise InvalidInput("callback_url must not carry credentials; callbacks are signed instead")
    allowed = settings.callback_allowed_hosts
    if not allowed:
        raise InvalidInput("callbacks are disabled on this service (ENGRAM_CALLBACK_HOSTS is empty)")
    host = parts.hostname.lower()
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InvalidInput(f"callback_url has an invalid port: {url!r}") from None
    if host not in allowed and f"{host}:{port}" not in allowed:
        raise InvalidInput(f"callback host {host}:{port} is not in the allowlist (ENGRAM_CALLBACK_HOSTS)")
    return url


def check_optional_url(url: str | None, settings: Settings) -> list[str]:
    """``[url]`` after :func:`check_callback_url`, or ``[]`` when no callback was asked for."""
    return [] if url is None else [check_callback_url(url, settings)]


# ---------------------------------------------------------------- signing


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value for one delivery (Standard Webhooks, ``v1``)."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify_signature(secret: str, headers: dict[str, str], body: bytes, tolerance_s: int = 300) -> bool:
    """What a receiver runs: True when the signature is valid and the timestamp recent.

    Args:
        secret: the shared ``ENGRAM_CALLBACK_SECRET``.
        headers: the request's headers (lower-case names).
        body: the raw request body, exactly as received.
        tolerance_s: how old a timestamp may be (replay protection).
    """
    try:
        timestamp = int(headers["webhook-timestamp"])
        expected = sign(secret, headers["webhook-id"], timestamp, body)
    except (KeyError, ValueError):
        return False
    if abs(time.time() - timestamp) > tolerance_s:
        return False
    offered = headers.get("webhook-signature", "").split()
    return any(hmac.compare_digest(expected, candidate) for candidate in offered)


# ---------------------------------------------------------------- the outbox


def _entry_key(job_id: str, url: str) -> str:
    return f"{PENDING_CALLBACKS}{job_id}.{hashlib.sha256(url.encode()).hexdigest()[:16]}.json"


def enqueue(storage: Storage, job: dict[str, Any]) -> None:
    """Write one outbox entry per callback URL of a finished job (idempotent: same keys)."""
    for url in job.get("callbacks") or []:
        entry = {"job_id": job["job_id"], "url": url, "attempts": 0, "next_attempt_at": 0.0, "last_error": None}
        storage.put_json(_entry_key(job["job_id"], url), entry)


@dataclass
class Delivery:
    """The outcome of one POST: ``ok`` for a 2xx answer, else why not."""

    ok: bool
    error: str | None = None


class CallbackDispatcher:
    """Delivers due outbox entries from a daemon thread.

    Args:
        storage: where the outbox and the job records are.
        settings: allowlist, secret, retry policy.
        get_job: reads a job record (the live store, so the freshest state is sent).
        view: turns a job record into what the API shows (the callback body carries the same).
        lock: a factory of a non-blocking lock shared by every API process (distributed mode), so
            one process delivers at a time; ``None`` in embedded mode.
    """

    def __init__(
        self,
        storage: Storage,
        settings: Settings,
        get_job: Callable[[str], dict[str, Any] | None],
        view: Callable[[dict[str, Any]], dict[str, Any]],
        lock: Callable[[], Any] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.storage, self.settings, self.get_job, self.view = storage, settings, get_job, view
        self._client = httpx.Client(timeout=settings.callback_timeout_s, follow_redirects=False, transport=transport)
        self._duty = PeriodicDuty("callbacks", self.deliver_due, settings.callback_poll_s, lock)

    def start(self) -> None:
        self._duty.start()

    def stop(self) -> None:
        self._duty.stop(timeout_s=self.settings.callback_timeout_s + 5)
        self._client.close()

    def wake(self) -> None:
        """Look at the outbox now (a job of this process just finished)."""
        self._duty.wake()

    def deliver_due(self) -> int:
        """Attempt every due entry once; returns how many were delivered."""
        delivered = 0
        for key in self.storage.list(PENDING_CALLBACKS):
            try:
                entry = self.storage.get_json(key)
            except (ObjectNotFound, ValueError):
                continue
            if entry["next_attempt_at"] <= time.time() and self._attempt(key, entry):
                delivered += 1
        return delivered

    def _attempt(self, key: str, entry: dict[str, Any]) -> bool:
        job = self.get_job(entry["job_id"])
        if job is None or job["status"] not in {"succeeded", "failed", "cancelled"}:
            return False  # the job is being run again: it will enqueue this entry once it ends
        outcome = self.post(entry["url"], job)
        if outcome.ok:
            self.storage.delete(key)
            log.info("callback for job %s delivered to %s", job["job_id"], entry["url"])
            return True
        entry["attempts"] += 1
        entry["last_error"] = outcome.error
        if entry["attempts"] >= self.settings.callback_max_attempts:
            log.error("callback for job %s to %s given up: %s", job["job_id"], entry["url"], outcome.error)
            self.storage.put_json(FAILED_CALLBACKS + key.removeprefix(PENDING_CALLBACKS), entry)
            self.storage.delete(key)
            return False
        delay = min(MAX_BACKOFF_S, self.settings.callback_backoff_s * 2 ** (entry["attempts"] - 1))
        entry["next_attempt_at"] = time.time() + delay
        log.warning("callback for job %s failed (%s); retry in %.1fs", job["job_id"], outcome.error, delay)
        self.storage.put_json(key, entry)
        return False

    def post(self, url: str, job: dict[str, Any]) -> Delivery:
        """One signed POST of the job to ``url`` (the allowlist is checked again: it may have changed)."""
        try:
            check_callback_url(url, self.settings)
        except InvalidInput as exc:
            return Delivery(False, f"refused: {exc.detail}")
        body = json.dumps({"type": EVENT, "data": self.view(job)}, sort_keys=True).encode()
        timestamp = int(time.time())
        assert self.settings.callback_secret is not None  # Settings refuses hosts without a secret
        headers = {
            "content-type": "application/json",
            "webhook-id": job["job_id"],
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self.settings.callback_secret.get_secret_value(), job["job_id"], timestamp, body),
            "user-agent": "engram-service-callbacks/1",
        }
        try:
            response = self._client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return Delivery(False, f"{type(exc).__name__}: {exc}")
        if 200 <= response.status_code < 300:
            return Delivery(True)
        return Delivery(False, f"HTTP {response.status_code}")
