"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api.deps import ContextDep
from service.observability import refresh_queue_depth

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


@router.get("/metrics", response_class=Response)
def metrics(ctx: ContextDep) -> Response:
    """Prometheus metrics of this process (request latency, jobs, collection throughput, queues)."""
    if ctx.queue_depths is not None:
        try:
            refresh_queue_depth(ctx.queue_depths)
        except Exception:  # the broker being away must not hide the other metrics
            pass
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
