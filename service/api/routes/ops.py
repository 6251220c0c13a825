"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api_schemas import Health, Identity, Readiness
from service.api.auth import request_principal
from service.api.deps import ContextDep, LanesDep
from service.context import Context
from service.errors import ServiceUnavailable
from service.observability import exposition, refresh_queue_depth
from service.universes.retention import refresh_metrics as refresh_universe_metrics

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health)
async def healthz() -> dict[str, str]:
    """The process is up (answered on the event loop: busy threads cannot delay it)."""
    return {"status": "ok"}


@router.get("/whoami", response_model=Identity)
def whoami(request: Request, ctx: ContextDep) -> Identity:
    """The caller's key fingerprint and scope, so a client (the console) offers only what the key may do."""
    principal = request_principal(request)
    auth = ctx.settings.api_keys is not None
    return Identity.model_validate({"auth": auth, "key": principal.key_id if auth else None, "scope": principal.scope})


@router.get("/readyz", response_model=Readiness, response_model_exclude_none=True)
async def readyz(ctx: ContextDep, lanes: LanesDep) -> dict[str, Any]:
    """Storage can serve requests and, in distributed mode, the broker answers and every queue has a
    worker with a live heartbeat; 503 naming what is missing otherwise."""
    workers = await lanes.status(_check_dependencies, ctx)
    ready: dict[str, Any] = {"status": "ready", "mode": "embedded" if ctx.settings.embedded else "distributed"}
    if workers is not None:
        ready["workers"] = workers
    if ctx.job_process_warm is not None:  # embedded: jobs queue until the job process is warm
        ready["job_process"] = "ready" if ctx.job_process_warm() else "starting"
    return ready


def _check_dependencies(ctx: Context) -> dict[str, int] | None:
    """Raises when a dependency is away; returns the live workers per queue (distributed mode)."""
    ctx.storage.ping()
    if ctx.broker_ping is not None:
        ctx.broker_ping()
    if ctx.live_workers is None:  # embedded: the job process is the API's own child
        return None
    workers: dict[str, int] = ctx.live_workers()
    idle = [queue for queue, count in workers.items() if count == 0]
    if idle:
        raise ServiceUnavailable(
            f"no live worker consumes queue{'s' if len(idle) > 1 else ''} {', '.join(idle)}: its jobs would wait "
            f"forever. Start `engram-service worker` (`--queues {','.join(idle)}`); a worker counts as live while "
            f"its heartbeat is younger than ENGRAM_HEARTBEAT_TTL_S={ctx.settings.heartbeat_ttl_s}s"
        )
    return workers


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
