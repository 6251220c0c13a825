"""Completion callbacks: when a job ends, POST it to the URLs its submitter gave.

Delivery is at least once and survives restarts: when a job with callbacks reaches a final state,
an outbox entry per URL is written to storage (``callbacks/pending/``) *before* the job's open
marker is dropped; a dispatcher thread in every API process delivers due entries, deletes an entry
only after a 2xx answer, and retries the others with exponential backoff
(``ENGRAM_CALLBACK_BACKOFF_S`` doubling up to 10 minutes, ``ENGRAM_CALLBACK_MAX_ATTEMPTS``), after
which the entry moves to ``callbacks/failed/`` with the reason (``last_error``). A failure of any
kind, an exception included, counts against its own entry only and never holds up the others; an
entry whose URL can never be sent (stored by an older version that accepted it) is dead-lettered at
once. The receiver deduplicates by the ``webhook-id`` header, which is the job ID (the same for every retry).

Security: only hosts in ``ENGRAM_CALLBACK_HOSTS`` may be called (checked when the URL is submitted,
so a refused URL is a 422 that stores nothing, and again before every delivery, on the host and port
as the HTTP client parses them: a URL that parsers read differently is refused), redirects are never
followed (a redirect could point anywhere), and every request is signed as Standard Webhooks
prescribe: ``webhook-signature: v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<body>")>``.

A receiver cannot hold a delivery, or the process's memory: one delivery (connect, request, status,
headers and what is read of the body) ends within ``ENGRAM_CALLBACK_TIMEOUT_S`` in total
(:mod:`service.jobs.callback_transport`), headers are bounded by the HTTP client (100 KB), and at most
``ENGRAM_CALLBACK_MAX_RESPONSE_BYTES`` of the body is read. A receiver that answers 2xx and then
streams forever has received the event (delivered); any other hostile answer fails its attempt and,
after ``ENGRAM_CALLBACK_MAX_ATTEMPTS``, is dead-lettered.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
import unicodedata
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from api_schemas import Job
from service.config import Settings
from service.errors import InvalidInput
from service.jobs.callback_transport import DeadlineTransport, deadline
from service.jobs.periodic import PeriodicDuty
from service.jobs.records import JobRecord
from service.storage.base import ObjectNotFound, Storage, StorageUnavailable
from service.storage.keys import FAILED_CALLBACKS, PENDING_CALLBACKS

log = logging.getLogger("engram.callbacks")
MAX_BACKOFF_S = 600.0
EVENT = "job.finished"
_SUBJECT = ("model_id", "concept", "variant_id")  # what a job is about, from its payload


def event_data(job: JobRecord) -> dict[str, Any]:
    """What a callback carries of a job (its event's ``data``): the fields of the API's
    :class:`~api_schemas.Job`, as the record stores them (no payload, no internals). The JSON at the
    edge: the API's view is :func:`service.jobs.store.public_view`, this validated."""
    stored = job.model_dump(mode="json")
    return {k: getattr(job.payload, k, None) if k in _SUBJECT else stored.get(k) for k in Job.model_fields}


# ---------------------------------------------------------------- what may be called


# A URL is shown and parsed the same way only when it holds no control, format (invisible, bidi) or
# whitespace character: Python's urlsplit silently drops a TAB or newline that httpx refuses, so
# the allowlist would judge one URL and the dispatcher send another (or fail on it forever).
_UNPRINTABLE = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Target:
    """Where a callback goes, as the HTTP client will send it: ``url`` is what is POSTed."""

    url: httpx.URL
    host: str
    port: int


def callback_target(url: str) -> Target:
    """``url`` parsed as httpx sends it, refused unless every parser reads the same host and port.

    Raises:
        InvalidInput: not an absolute http(s) URL, credentials in it, an unprintable character,
            a URL httpx refuses, or a scheme, host or port that ``urlsplit`` reads otherwise than
            httpx (the allowlist must judge the place the request really goes to).
    """
    bad = next((i for i, ch in enumerate(url) if unicodedata.category(ch) in _UNPRINTABLE), None)
    if bad is not None:
        raise InvalidInput(
            f"callback_url holds a control or whitespace character ({ascii(url[bad])} at position {bad}): "
            "remove it, or percent-encode it in the path or query"
        )
    parts = urlsplit(url)
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise InvalidInput(f"callback_url must be an absolute http(s) URL, got {url!r}")
    if parts.username is not None or parts.password is not None:
        raise InvalidInput("callback_url must not carry credentials; callbacks are signed instead")
    try:
        split_port = parts.port
        sent = httpx.URL(url)
        host = sent.raw_host.decode("ascii").lower()
    except (httpx.InvalidURL, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidInput(f"callback_url cannot be sent: {exc}") from None
    default = _DEFAULT_PORTS[parts.scheme]
    port = sent.port if sent.port is not None else default
    seen = (parts.scheme, parts.hostname.lower(), split_port if split_port is not None else default)
    if (sent.scheme, host, port) != seen:
        raise InvalidInput(
            f"callback_url is read as {seen[0]}://{seen[1]}:{seen[2]} by one URL parser and as "
            f"{sent.scheme}://{host}:{port} by the HTTP client: write the host in plain ASCII "
            "(IDNA 'xn--' form for an international name) and the port as decimal digits"
        )
    if not 1 <= port <= 65535:
        raise InvalidInput(f"callback_url has an invalid port {port}: use 1 to 65535")
    return Target(sent, host, port)


def check_callback_url(url: str, settings: Settings) -> str:
    """The URL, if callbacks may reach it; otherwise an :class:`InvalidInput` (422) saying why.

    Args:
        url: what the user sent as ``callback_url``.
        settings: carries the allowlist ``ENGRAM_CALLBACK_HOSTS``.

    Returns:
        ``url`` unchanged.
    """
    _allowed_target(url, settings)
    return url


def _allowed_target(url: str, settings: Settings) -> Target:
    target = callback_target(url)
    allowed = settings.callback_allowed_hosts
    if not allowed:
        raise InvalidInput("callbacks are disabled on this service (ENGRAM_CALLBACK_HOSTS is empty)")
    if target.host not in allowed and f"{target.host}:{target.port}" not in allowed:
        raise InvalidInput(f"callback host {target.host}:{target.port} is not in the allowlist (ENGRAM_CALLBACK_HOSTS)")
    return target


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


def enqueue(storage: Storage, job: JobRecord, urls: tuple[str, ...] | None = None) -> None:
    """Write one outbox entry per callback URL of a finished job, or per one of ``urls`` (idempotent: same keys)."""
    for url in job.callbacks if urls is None else urls:
        entry = {"job_id": job.job_id, "url": url, "attempts": 0, "next_attempt_at": 0.0, "last_error": None}
        storage.put_json(_entry_key(job.job_id, url), entry)


@dataclass
class Delivery:
    """The outcome of one POST: ``ok`` for a 2xx answer, else why not; ``final`` when retrying
    cannot help (a URL that can never be sent), so the entry is dead-lettered at once."""

    ok: bool
    error: str | None = None
    final: bool = False


_ENTRY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "job_id": str,
    "url": str,
    "attempts": int,
    "next_attempt_at": (int, float),
}


def _entry_problem(entry: Any) -> str | None:
    """Why an outbox entry cannot be delivered as stored (``None``: it can be attempted)."""
    if not isinstance(entry, dict):
        return f"the outbox entry is a JSON {type(entry).__name__}, not an object"
    for name, kind in _ENTRY_FIELDS.items():
        if not isinstance(entry.get(name), kind) or isinstance(entry.get(name), bool):
            return f"the outbox entry's {name!r} is missing or not a {getattr(kind, '__name__', 'number')}"
    return None


class CallbackDispatcher:
    """Delivers due outbox entries from a daemon thread.

    Every entry is handled on its own, up to ``ENGRAM_CALLBACK_CONCURRENCY`` at once, so a receiver
    that answers slowly delays no other; whatever goes wrong with one (a URL that cannot be sent, a
    receiver that fails, an exception nobody foresaw, an entry that is not one) counts against that
    entry only, which is retried with backoff and then moved to ``callbacks/failed/`` with the
    reason (``last_error``); the entries after it are delivered in the same pass. Only storage being
    unavailable ends a pass early (every entry would fail the same way; the next pass retries).

    Args:
        storage: where the outbox and the job records are.
        settings: allowlist, secret, retry policy.
        get_job: reads a job record (the live store, so the freshest state is sent).
        lock: a factory of a non-blocking lock shared by every API process (distributed mode), so
            one process delivers at a time; ``None`` in embedded mode.
        transport: the HTTP transport (tests put a failing one in front of the real one); by
            default one that keeps every delivery within ENGRAM_CALLBACK_TIMEOUT_S in total.
    """

    def __init__(
        self,
        storage: Storage,
        settings: Settings,
        get_job: Callable[[str], JobRecord | None],
        lock: Callable[[], Any] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.storage, self.settings, self.get_job = storage, settings, get_job
        self._client = httpx.Client(
            timeout=settings.callback_timeout_s,
            follow_redirects=False,
            transport=transport or DeadlineTransport(settings.callback_concurrency),
        )
        self._pool = ThreadPoolExecutor(settings.callback_concurrency, thread_name_prefix="engram-callback")
        self._duty = PeriodicDuty("callbacks", self.deliver_due, settings.callback_poll_s, lock)

    def start(self) -> None:
        self._duty.start()

    def stop(self) -> None:
        self._duty.stop(timeout_s=self.settings.callback_timeout_s + 5)
        self.close()

    def close(self) -> None:
        """Release the HTTP client and the delivery threads (what :meth:`stop` ends with)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def wake(self) -> None:
        """Look at the outbox now (a job of this process just finished)."""
        self._duty.wake()

    def deliver_due(self) -> int:
        """Attempt every due entry once, ``ENGRAM_CALLBACK_CONCURRENCY`` at a time (a receiver that
        answers slowly holds one lane, not the pass); returns how many were delivered."""
        keys = self.storage.list(PENDING_CALLBACKS)
        # map() re-raises StorageUnavailable (every entry would fail alike: the next pass tries again).
        return sum(self._pool.map(self._deliver_guarded, keys))

    def _deliver_guarded(self, key: str) -> bool:
        try:
            return self._deliver_entry(key)
        except StorageUnavailable:
            raise
        except Exception as exc:  # recording the outcome failed: this entry only, the others go on
            log.warning("callback outbox entry %s skipped this pass: %s: %s", key, type(exc).__name__, exc)
            return False

    def _deliver_entry(self, key: str) -> bool:
        try:
            entry = self.storage.get_json(key)
        except ObjectNotFound:
            return False  # delivered or dead-lettered by another pass meanwhile
        except ValueError as exc:
            self._dead_letter(key, {"raw": None}, f"the outbox entry is not JSON: {exc}")
            return False
        problem = _entry_problem(entry)
        if problem is not None:
            self._dead_letter(key, entry if isinstance(entry, dict) else {"raw": entry}, problem)
            return False
        if entry["next_attempt_at"] > time.time():
            return False
        outcome = self._attempt(entry)
        if outcome is None:
            return False
        self._record(key, entry, outcome)
        return outcome.ok

    def _attempt(self, entry: dict[str, Any]) -> Delivery | None:
        """One delivery of an entry; ``None`` while its job is being run again (it will enqueue
        the entry anew once it ends)."""
        try:
            job = self.get_job(entry["job_id"])
            if job is None:
                return Delivery(False, f"job {entry['job_id']} no longer exists")
            if job.status not in {"succeeded", "failed", "cancelled"}:
                return None
            return self.post(entry["url"], job)
        except StorageUnavailable:
            raise
        except Exception as exc:  # an entry must never stop the pass: it fails, and is retried
            return Delivery(False, f"{type(exc).__name__}: {exc}")

    def _record(self, key: str, entry: dict[str, Any], outcome: Delivery) -> None:
        """Delete a delivered entry; schedule a failed one's retry, or dead-letter it."""
        job_id, url = entry["job_id"], entry["url"]
        if outcome.ok:
            self.storage.delete(key)
            log.info("callback for job %s delivered to %r", job_id, url)
            return
        entry["attempts"] += 1
        entry["last_error"] = outcome.error
        if outcome.final or entry["attempts"] >= self.settings.callback_max_attempts:
            self._dead_letter(key, entry, outcome.error or "failed")
            return
        delay = min(MAX_BACKOFF_S, self.settings.callback_backoff_s * 2 ** (entry["attempts"] - 1))
        entry["next_attempt_at"] = time.time() + delay
        log.warning("callback for job %s to %r failed (%s); retry in %.1fs", job_id, url, outcome.error, delay)
        self.storage.put_json(key, entry)

    def _dead_letter(self, key: str, entry: dict[str, Any], reason: str) -> None:
        """Move an entry to ``callbacks/failed/`` (same name) with the reason it was given up."""
        failed = {**entry, "last_error": reason, "failed_at": time.time()}
        log.error("callback for job %s to %r given up: %s", entry.get("job_id"), entry.get("url"), reason)
        self.storage.put_json(FAILED_CALLBACKS + key.removeprefix(PENDING_CALLBACKS), failed)
        self.storage.delete(key)

    def post(self, url: str, job: JobRecord) -> Delivery:
        """One signed POST of the job to ``url`` (checked again: the allowlist may have changed, and
        an entry stored by an older version may hold a URL no longer accepted)."""
        try:
            callback_target(url)
        except InvalidInput as exc:
            return Delivery(False, f"the URL can never be sent: {exc.detail}", final=True)
        try:
            target = _allowed_target(url, self.settings)
        except InvalidInput as exc:  # the allowlist may be widened again by a restart: retried
            return Delivery(False, f"refused: {exc.detail}")
        body = json.dumps({"type": EVENT, "data": event_data(job)}, sort_keys=True).encode()
        timestamp = int(time.time())
        assert self.settings.callback_secret is not None  # Settings refuses hosts without a secret
        headers = {
            "content-type": "application/json",
            "webhook-id": job.job_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self.settings.callback_secret.get_secret_value(), job.job_id, timestamp, body),
            "user-agent": "engram-service-callbacks/1",
        }
        try:  # the URL the allowlist judged is the one sent
            with deadline(self.settings.callback_timeout_s):
                status = self._send(target.url, body, headers)
        except Exception as exc:  # httpx.HTTPError, and whatever else a transport raises
            return Delivery(False, f"{type(exc).__name__}: {exc}")
        if 200 <= status < 300:
            return Delivery(True)
        return Delivery(False, f"HTTP {status}")

    def _send(self, url: httpx.URL, body: bytes, headers: dict[str, str]) -> int:
        """POST and return the answer's status, having read at most ENGRAM_CALLBACK_MAX_RESPONSE_BYTES of
        its body, raw (never decompressed): the status alone decides the outcome (Standard Webhooks:
        a 2xx acknowledges the event), so the body is read only to let a short answer's connection be
        reused; a longer one, or one still arriving at the deadline, is dropped with its connection."""
        with self._client.stream("POST", url, content=body, headers=headers) as response:
            read = 0
            try:
                for chunk in response.iter_raw():
                    read += len(chunk)
                    if read > self.settings.callback_max_response_bytes:
                        break  # closing an unread response closes its connection
            except httpx.HTTPError as exc:  # the answer was given: its body's fate changes nothing
                log.info("callback answer from %s not read to its end (%s): %s", url.host, type(exc).__name__, exc)
            return response.status_code
