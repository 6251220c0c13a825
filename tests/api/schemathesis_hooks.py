"""Schemathesis hooks for tests/api/test_schemathesis.py (loaded by the CLI through ``SCHEMATHESIS_HOOKS``).

One extra check, ``auth_is_enforced``: on a server with ``ENGRAM_API_KEYS``, every request to a
protected operation that does not carry the configured key (``ENGRAM_SCHEMATHESIS_KEY``, empty in
the run without a key) is answered 401 with a problem+json body and a ``WWW-Authenticate``
challenge (or 413 when its body is over the limit: that check comes first); one that carries it is
never a 401 or a 403 (the key is ``admin``).
"""

from __future__ import annotations

import os

import schemathesis

from service.api.auth import PUBLIC_PATHS, APIKeyAuth

_KEY = os.environ.get("ENGRAM_SCHEMATHESIS_KEY", "")
_AUTH = APIKeyAuth(app=None, keys={_KEY: "admin"} if _KEY else {})  # type: ignore[arg-type]


@schemathesis.check
def auth_is_enforced(ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case) -> None:
    if case.operation.path in PUBLIC_PATHS:
        return
    sent = response.request.headers.get("Authorization")
    valid = sent is not None and _AUTH.authenticate([sent.encode("latin-1", "replace")]) is not None
    if valid:
        if response.status_code in (401, 403):
            raise AssertionError(f"the admin key was refused with {response.status_code}")
        return
    if response.status_code == 413:
        return  # by design the size limit answers first, before any auth (see service.api.auth)
    if response.status_code != 401:
        raise AssertionError(f"a request without a valid API key was answered {response.status_code}, not 401")
    content_type = (response.headers.get("content-type") or [""])[0]
    if not content_type.startswith("application/problem+json"):
        raise AssertionError(f"the 401 is {content_type!r}, not application/problem+json")
    if not response.headers.get("www-authenticate"):
        raise AssertionError("the 401 has no WWW-Authenticate challenge")
