"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import ContextDep

router = APIRouter(tags=["operations"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(ctx: ContextDep) -> dict[str, str]:
    """Storage (and the broker, when configured) can serve requests; 503 otherwise."""
    ctx.storage.ping()
    if ctx.broker_ping is not None:
        ctx.broker_ping()
    return {"status": "ready", "mode": "embedded" if ctx.settings.embedded else "distributed"}
