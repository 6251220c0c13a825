"""The hottest polls answered from memory, without the framework's routing, injection and validation.

Clients poll ``GET /jobs/{id}`` and ``GET /concepts/{name}`` in loops; measured with 200 pollers,
FastAPI's routing, dependency solving and response validation were about three quarters of each
poll's cost on the event loop. This pure ASGI middleware answers those two (and ``/healthz``)
itself, but only when everything the answer needs is already in this process's memory or in a
local file read (:attr:`service.jobs.store.JobStore.reads_are_local`: the embedded SQLite live store, not Redis);
otherwise, and for anything else, the request goes on to the routes, which give the same answer
(``tests/api/test_waiting_and_polling.py`` checks that both agree).

It sits inside the auth middleware (keys and scopes apply as to any route) and inside
:class:`service.observability.RequestContext` (request ID, latency metric under the route's template).
The bodies are the routes' response models (:class:`api_schemas.Job`, :class:`api_schemas.Concept`),
serialised by pydantic as FastAPI would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from api_schemas import Concept
from api_schemas.concepts import ConceptModelState as ModelStateView
from service.concepts.record import read_concept
from service.concepts.service import concept_fields, ready_state
from service.context import Context
from service.jobs.records import JobRecord, UnreadableJobRecord
from service.jobs.store import public_view, valid_job_id
from service.models.stored import FORMAT_VERSION
from service.statistics.key import manifest_key
from service.statistics.manifest import read_statistics_manifest
from service.storage.keys import concept_key
from service.storage.stored_json import UnreadableRecord

_JSON_HEADERS = [(b"content-type", b"application/json")]
_HEALTHY = json.dumps({"status": "ok"}).encode()


@dataclass(frozen=True)
class _Route:
    """What :class:`~service.observability.RequestContext` reads to label the latency metric (``route.path``)."""

    path: str


JOB_ROUTE, CONCEPT_ROUTE, HEALTH_ROUTE = _Route("/jobs/{job_id}"), _Route("/concepts/{name}"), _Route("/healthz")


class FastStatus:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and not scope.get("query_string"):
            answer = self._answer(scope)
            if answer is not None:
                route, body = answer
                scope["route"] = route
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def _answer(self, scope: Scope) -> tuple[_Route, bytes] | None:
        path: str = scope["path"]
        if path == "/healthz":
            return HEALTH_ROUTE, _HEALTHY
        app = scope.get("app")
        # starlette's State raises AttributeError for a name not set yet (the app sets ctx at start-up)
        ctx = getattr(app.state, "ctx", None) if isinstance(app, Starlette) else None
        if not isinstance(ctx, Context) or not ctx.jobs.reads_are_local:
            return None
        if path.startswith("/jobs/"):
            job = _local_job(ctx, path[len("/jobs/") :])
            return None if job is None else (JOB_ROUTE, public_view(job).model_dump_json().encode())
        if path.startswith("/concepts/"):
            view = _concept_view(ctx, path[len("/concepts/") :])
            return None if view is None else (CONCEPT_ROUTE, view.model_dump_json().encode())
        return None


def _local_job(ctx: Context, job_id: str) -> JobRecord | None:
    """The live record; None when there is none, or it cannot be read: the route then answers (an
    unreadable record as its problem, which this middleware, outside the app's handlers, cannot)."""
    try:
        return ctx.jobs.get_live(job_id) if valid_job_id(job_id) else None
    except UnreadableJobRecord:
        return None


def _concept_view(ctx: Context, name: str) -> Concept | None:
    """The concept's view when its document, its jobs and any published manifests are in memory."""
    key = concept_key(name)
    hit, data = ctx.reads.peek(key)
    if not hit or data is None or data.get("format_version") != FORMAT_VERSION:
        return None  # unknown here (or unreadable): the route reads storage, and answers 404 (or the refusal)
    try:
        concept = read_concept(key, data)
    except UnreadableRecord:
        return None  # the route answers its refusal (this middleware, outside the app's handlers, cannot)
    states: dict[str, ModelStateView] = {}
    for model_id, entry in concept.models.items():
        job = _local_job(ctx, entry.job_id)
        if job is None:
            return None
        # No statistics key while a dataset reference is not resolved: the job's state says it all.
        published_hit, published = ctx.reads.peek(manifest_key(entry.stats)) if entry.stats else (False, None)
        if entry.stats and published_hit and published is not None:
            states[model_id] = ready_state(read_statistics_manifest(entry.stats, published), entry.job_id)
        elif job.status in {"queued", "running"}:
            status: Literal["collecting", "pending"] = "collecting" if job.status == "running" else "pending"
            states[model_id] = ModelStateView(status=status, tokens=None, job_id=entry.job_id)
        else:
            return None  # finished: whether it published is a storage read, the route's to make
    return concept_fields(concept, states)  # what the route shows besides the states (registry.concept_view)
