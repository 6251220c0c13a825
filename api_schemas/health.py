"""Liveness and readiness: ``GET /healthz`` and ``GET /readyz``."""

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
