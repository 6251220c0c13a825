"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.deps import ContextDep, LanesDep
from service.observability import exposition, refresh_queue_depth
from service.registry import Context
from service.universes.retention import refresh_metrics as refresh_universe_metrics

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (answered on the event loop: busy threads cannot delay it)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(ctx: ContextDep, lanes: LanesDep) -> dict[str, str]:
    """Storage (and the broker, when configured) can serve requests; 503 otherwise."""
    await lanes.status(_ping_dependencies, ctx)
    return {"status": "ready", "mode": "embedded" if ctx.settings.embedded else "distributed"}


def _ping_dependencies(ctx: Context) -> None:
    ctx.storage.ping()
    if ctx.broker_ping is not None:
        ctx.broker_ping()


@router.get("/metrics", response_class=Response)
def metrics(ctx: ContextDep) -> Response:
    """Prometheus metrics of this process (request latency, jobs, collection throughput, queues, universe bytes)."""
    if ctx.queue_depths is not None:
        try:
            refresh_queue_depth(ctx.queue_depths)
        except Exception:  # the broker being away must not hide the other metrics
            pass
    refresh_universe_metrics(ctx)  # bytes from storage itself: right whichever process built or evicted
    return Response(exposition(), media_type=CONTENT_TYPE_LATEST)
