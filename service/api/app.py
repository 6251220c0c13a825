"""The FastAPI application factory."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.api.problems import BodySizeLimit, install_problem_handlers
from service.api.routes import concepts, jobs, models, ops, variants
from service.config import Settings, get_settings
from service.jobs import EmbeddedExecutor, JobStore
from service.registry import Context
from service.storage import open_storage
from service.tasks import run_job

log = logging.getLogger("engram.api")


def build_context(settings: Settings) -> tuple[Context, EmbeddedExecutor]:
    """Storage, job store and the embedded executor wired together."""
    storage = open_storage(settings.storage_url, settings.s3_endpoint_url)
    ctx = Context(settings=settings, storage=storage, jobs=JobStore(storage), dispatch=None, lock=threading.RLock())
    executor = EmbeddedExecutor(lambda job_id: run_job(ctx, job_id))
    ctx.dispatch = executor.submit
    return ctx, executor


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    if settings.broker_url:
        raise RuntimeError("distributed mode (ENGRAM_BROKER_URL) is not available in this build yet")
    ctx, executor = build_context(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for job in ctx.jobs.unfinished():  # interrupted by a restart: run again (tasks are idempotent)
            log.info("re-queueing interrupted job %s", job["job_id"])
            ctx.jobs.update(job["job_id"], status="queued")
            executor.submit(job)
        yield
        executor.shutdown()

    app = FastAPI(
        title="Engram Service",
        version="0.1.0",
        description="Closed-form unlearning and engram arithmetic for transformers models.",
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    install_problem_handlers(app)
    app.add_middleware(BodySizeLimit, json_limit=settings.max_json_bytes, upload_limit=settings.max_upload_bytes)
    for module in (models, concepts, jobs, variants, ops):
        app.include_router(module.router)
    return app
