"""API-key auth: ``Authorization: Bearer <key>`` with a ``read``, ``write`` or ``admin`` scope.

``ENGRAM_API_KEYS`` (comma-separated ``key:scope``) is parsed once, at start-up, by
:func:`install_auth`; a bad entry stops the service with a ``ValueError`` that names the entry's
index but never its text (the text may be, or contain, a key). Unset: no auth at all (the CLI
warns at start-up).

Why a pure ASGI middleware rather than a FastAPI dependency on every router:

* it covers everything the app serves, not only the routers someone remembered to guard: the
  routes FastAPI adds itself (``/docs``, ``/redoc``, ``/openapi.json``), a future ``/metrics``
  mounted as a plain ASGI app, future routers, and unknown paths (a client without a key gets 401,
  not 404, so routes cannot be enumerated without a key);
* it answers before the request body is read: FastAPI reads and validates a body *before* it
  runs dependencies, so a dependency would let anyone make the server parse a large JSON body,
  and a bad body would get a 422 that reveals the schema ahead of the 401.

Note: ``install_auth`` runs before ``BodySizeLimit`` is added, and Starlette wraps later
middleware around earlier ones, so an oversized ``Content-Length`` gets its 413 before auth is
checked. That reveals only the configured limit, and no body is read either way.

Scopes (``admin`` ⊃ ``write`` ⊃ ``read``):

* ``/healthz`` and ``/readyz``: public (load balancers and orchestrators probe them without keys).
* ``/ui`` and below: public. The console's shell (HTML, CSS, JavaScript shipped in the package) holds
  no data: a browser cannot send a bearer key with a page load, so the page asks for the key and every
  request its script makes carries it, under the same scopes as any client's (service/console).
* ``GET /audit``: ``admin`` (the audit log names every key's requests).
* ``GET``/``HEAD`` of anything else: ``read``. That includes ``/docs``, ``/redoc``,
  ``/openapi.json`` and ``/metrics``: the API description and the counters are not secret
  enough for ``write``, but the contract keeps every route but the probes behind a key
  (Prometheus sends one with ``authorization: {credentials: ...}``; a browser on ``/docs`` needs an
  extension or a proxy that adds the header). A read never causes a job or a write: a ``GET`` that
  would start work (a memory-trace map not computed yet) answers a read key 403 naming the write
  key that may ask for it (:func:`may_start_work`, checked by the route, which knows).
* ``POST``/``DELETE`` under ``/models``, ``/concepts``, ``/variants``: ``write``. That includes
  ``POST /models/{id}/unlearn`` and ``/compose``, which build variants.
* anything else: ``admin``. In particular ``DELETE /jobs/{id}``: jobs carry no owner, so
  "cancel your own collection" cannot be enforced, and a ``write`` key that could cancel any job
  could stop everyone else's work. The contract's ``write`` scope lists models, concepts and
  variants only, so cancellation is ``admin``. Unknown methods and future routes fail closed to
  ``admin`` too.

Keys are compared in constant time: the presented token and every configured key are hashed
(SHA-256, so lengths do not leak either) and the token is compared with *every* key with
``hmac.compare_digest``, without stopping at a match. Keys are never logged and never appear in a
response; the request's scope and the key's identity (:func:`key_identity`: ``key-`` and the first 12
hex digits of the key's SHA-256, the same whatever the order of ``ENGRAM_API_KEYS``, so records that
name it, such as a universe's users, stay right when keys are added or removed) are put in
``request.state.auth`` for handlers that want it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service.config import Settings
from service.errors import Forbidden, ProblemError, Unauthorized
from service.jobs.admission import ANONYMOUS as ANONYMOUS_OWNER

log = logging.getLogger("engram.api")

SCOPES = ("read", "write", "admin")
RANK = {name: rank for rank, name in enumerate(SCOPES)}
MIN_KEY_LENGTH = 16
PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
CONSOLE_PATH = "/ui"  # the console's static shell: public, it holds no data (module docstring)
ADMIN_READ_PATHS = frozenset({"/audit"})  # who did what: not for every reader
WRITE_PREFIXES = ("/models", "/concepts", "/variants")
WRITE_METHODS = frozenset({"POST", "DELETE"})
READ_METHODS = frozenset({"GET", "HEAD"})
REALM = 'Bearer realm="engram-service"'
PROBLEM_JSON = "application/problem+json"


@dataclass(frozen=True)
class Principal:
    """Who made a request: the configured key's index (never the key) and its scope."""

    key_id: str
    scope: str


@dataclass(frozen=True)
class _Key:
    digest: bytes
    principal: Principal


def parse_api_keys(raw: str) -> dict[str, str]:
    """``"k1:read,k2:admin"`` -> ``{"k1": "read", "k2": "admin"}``.

    Each comma-separated entry is ``key:scope`` (surrounding whitespace ignored; the scope is
    what follows the last ``:``). The key is at least 16 visible ASCII characters (no spaces: it
    travels in a header); the scope is ``read``, ``write`` or ``admin``; no key appears twice.

    Raises:
        ValueError: an entry is invalid, or there is none. The message names the entry by its
            1-based index and never contains any part of it.
    """
    entries = raw.split(",")
    if not raw.strip():
        raise ValueError("ENGRAM_API_KEYS is set but empty: unset it to disable auth, or list key:scope entries")
    keys: dict[str, str] = {}
    for index, entry in enumerate(entries, start=1):
        where = f"ENGRAM_API_KEYS entry {index} of {len(entries)}"
        entry = entry.strip()
        if not entry:
            raise ValueError(f"{where} is empty (a stray comma?)")
        key, colon, scope = entry.rpartition(":")
        if not colon:
            raise ValueError(f"{where} is not key:scope")
        scope = scope.strip().lower()
        if scope not in RANK:
            raise ValueError(f"{where}: the scope must be one of {', '.join(SCOPES)}")
        key = key.strip()
        if len(key) < MIN_KEY_LENGTH:
            raise ValueError(f"{where}: the key must be at least {MIN_KEY_LENGTH} characters")
        if not all("!" <= ch <= "~" for ch in key):
            raise ValueError(f"{where}: the key may hold only visible ASCII characters (no spaces)")
        if key in keys:
            raise ValueError(f"{where} repeats the key of an earlier entry")
        keys[key] = scope
    return keys


# Who calls when auth is off: one caller with every right, counted as one key by admission control.
ANONYMOUS = Principal(ANONYMOUS_OWNER, "admin")


def request_principal(request: Request) -> Principal:
    """The principal the middleware admitted this request as; :data:`ANONYMOUS` without auth."""
    principal = getattr(request.state, "auth", None)  # starlette's State raises AttributeError for a name never set
    return principal if isinstance(principal, Principal) else ANONYMOUS


def may_start_work(principal: Principal) -> bool:
    """Whether a request may cause a job or a write: a read key never does, whatever the route."""
    return RANK[principal.scope] >= RANK["write"]


def required_scope(method: str, path: str) -> str | None:
    """The scope a request needs; None for the public probes."""
    if path in PUBLIC_PATHS or (method in READ_METHODS and _is_console(path)):
        return None
    if path in ADMIN_READ_PATHS:
        return "admin"
    if method in READ_METHODS:
        return "read"
    if method in WRITE_METHODS and any(path == p or path.startswith(p + "/") for p in WRITE_PREFIXES):
        return "write"
    return "admin"


def _is_console(path: str) -> bool:
    return path == CONSOLE_PATH or path.startswith(CONSOLE_PATH + "/")


def key_identity(key: str) -> str:
    """A key's stable, printable identity: ``key-`` + 12 hex digits of its SHA-256 (an operator finds
    it with ``printf %s "$KEY" | sha256sum | cut -c1-12``). 48 bits of a hash of a key of at least 16
    characters tell nothing usable about the key."""
    return "key-" + hashlib.sha256(key.encode("ascii")).hexdigest()[:12]


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class APIKeyAuth:
    """Pure ASGI middleware: 401 without a valid bearer key, 403 when its scope is too small."""

    def __init__(self, app: ASGIApp, keys: Mapping[str, str]) -> None:
        self.app = app
        self._keys = tuple(
            _Key(_digest(key.encode("ascii")), Principal(key_identity(key), scope)) for key, scope in keys.items()
        )

    def authenticate(self, authorization: list[bytes]) -> Principal | None:
        """The principal of the ``Authorization`` header values, or None (missing, malformed, unknown)."""
        if len(authorization) != 1:
            return None
        scheme, _, token = authorization[0].strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return None
        presented = _digest(token)
        match: Principal | None = None
        for key in self._keys:  # every key, no early exit: timing does not tell which one matched
            if hmac.compare_digest(presented, key.digest):
                match = key.principal
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websocket routes exist: refuse rather than serve them unauthenticated
            await send({"type": "websocket.close", "code": 1008})
            return
        needed = required_scope(scope["method"].upper(), _route_path(scope))
        if needed is None:
            await self.app(scope, receive, send)
            return
        authorization = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        principal = self.authenticate(authorization)
        if principal is None:
            detail = (
                "this request needs an API key: send Authorization: Bearer <key>"
                if not authorization
                else "the Authorization header does not carry a valid API key (expected: Bearer <key>)"
            )
            challenge = REALM if not authorization else f'{REALM}, error="invalid_token"'
            await _reject(Unauthorized(detail), {"WWW-Authenticate": challenge}, scope, receive, send)
            return
        scope.setdefault("state", {})["auth"] = principal  # set before a 403 too: the audit log names the key refused
        if RANK[principal.scope] < RANK[needed]:
            problem = Forbidden(
                f"{scope['method']} {_route_path(scope)} needs the {needed} scope; this key has {principal.scope}"
            )
            challenge = f'{REALM}, error="insufficient_scope", scope="{needed}"'
            await _reject(problem, {"WWW-Authenticate": challenge}, scope, receive, send)
            return
        await self.app(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path the router matches (``root_path`` removed), so auth and routing see the same path."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


async def _reject(problem: ProblemError, headers: dict[str, str], scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(
        problem.to_problem().model_dump(mode="json"), status_code=problem.status, media_type=PROBLEM_JSON, headers=headers
    )
    await response(scope, receive, send)


def install_auth(app: FastAPI, settings: Settings) -> None:
    """Enforce ``ENGRAM_API_KEYS`` on ``app``; no-op when it is unset.

    Raises:
        ValueError: ``ENGRAM_API_KEYS`` is malformed (the message never contains a key).
    """
    if settings.api_keys is None:
        return
    keys = parse_api_keys(settings.api_keys)
    counts: dict[str, int] = {s: sum(1 for v in keys.values() if v == s) for s in SCOPES}
    log.info("API key auth enabled: %d keys (%s)", len(keys), ", ".join(f"{n} {s}" for s, n in counts.items()))
    app.add_middleware(APIKeyAuth, keys=keys)
