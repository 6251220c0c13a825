"""The FastAPI application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.api.audit import AuditLog
from service.api.auth import install_auth
from service.api.fast_status import FastStatus
from service.api.lanes import Lanes
from service.api.openapi import install_openapi
from service.api.problems import BodySizeLimit, install_problem_handlers
from service.api.routes import audit, calibration, concepts, evaluation, jobs, maps, models, ops, universes, variants
from service.config import Settings, get_settings
from service.console.mount import install_console
from service.execution.runtime import build_runtime
from service.observability import RequestContext


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    runtime = build_runtime(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runtime.start()
        yield
        runtime.stop()

    app = FastAPI(
        title="Engram Service",
        version="0.1.0",
        description="Closed-form unlearning and engram arithmetic for transformers models.",
        lifespan=lifespan,
        docs_url=None,  # install_openapi serves /docs and /redoc from local assets
        redoc_url=None,
    )
    app.state.ctx = runtime.ctx
    app.state.lanes = Lanes(settings.max_waiters)
    install_problem_handlers(app, settings.max_json_values)
    app.add_middleware(FastStatus)  # inside auth: keys and scopes apply to the polls it answers
    install_auth(app, settings)
    app.add_middleware(BodySizeLimit, json_limit=settings.max_json_bytes, upload_limit=settings.max_upload_bytes)
    # Outside auth and the size limit, inside the request ID: it records their refusals with the ID.
    app.add_middleware(AuditLog, storage=runtime.ctx.storage, auth_on=settings.api_keys is not None)
    app.add_middleware(RequestContext)  # outermost: every response, even a 401 or 413, gets an ID
    # maps, universes and calibration before models: its {model_id:path} would take their paths.
    for module in (maps, universes, calibration, models, concepts, jobs, variants, evaluation, ops, audit):
        app.include_router(module.router)
    install_openapi(app, settings)
    install_console(app)
    return app
