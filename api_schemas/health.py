"""Liveness, readiness and the caller's identity: ``GET /healthz``, ``GET /readyz``, ``GET /whoami``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from api_schemas.common import DictReadable


class Health(DictReadable):
    """The process is up."""

    status: Literal["ok"] = "ok"


class Readiness(DictReadable):
    """Jobs can run: storage answers and, in distributed mode, the broker answers and every queue has a worker."""

    status: Literal["ready"] = "ready"
    mode: Literal["embedded", "distributed"] = Field(
        description="embedded: jobs run in the API's own job process; distributed: Celery workers run them"
    )
    workers: dict[str, int] | None = Field(
        default=None, description="distributed mode: the live workers per queue (absent in embedded mode)"
    )
    job_process: Literal["starting", "ready"] | None = Field(
        default=None,
        description=(
            "embedded mode: `starting` while the job process imports the job bodies (a job submitted "
            "meanwhile waits in the queue), then `ready` (absent in distributed mode)"
        ),
    )


class Identity(DictReadable):
    """Who the service takes the caller for: what a client (or the console) may offer its user."""

    auth: bool = Field(description="whether the service checks API keys (ENGRAM_API_KEYS is set)")
    key: str | None = Field(
        default=None,
        description="the key's fingerprint (`key-` and 12 hex digits of its SHA-256), as the audit log and "
        "records name it; null without auth",
    )
    scope: Literal["read", "write", "admin"] = Field(
        description="what the key may do: `read` may GET; `write` may also POST/DELETE models, concepts and "
        "variants; `admin` everything. Without auth every caller is `admin`"
    )
