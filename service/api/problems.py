"""Every error as application/problem+json, and request-size limits that apply before parsing."""

from __future__ import annotations

import logging
from typing import Any

import kombu.exceptions
import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, ProblemError, ServiceUnavailable
from service.storage import StorageUnavailable

log = logging.getLogger("engram.api")
PROBLEM_JSON = "application/problem+json"


def problem_response(status: int, title: str, detail: str, slug: str, **extra: Any) -> JSONResponse:
    body = {"type": f"https://engram.dev/problems/{slug}", "title": title, "status": status, "detail": detail}
    body.update({k: v for k, v in extra.items() if v is not None})
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON)


RETRY_AFTER_S = 5  # a dependency that went away usually comes back within seconds (restart, failover)


def _unavailable(detail: str) -> JSONResponse:
    """503 with ``Retry-After``, so clients back off instead of hammering a recovering service."""
    problem = ServiceUnavailable(detail).to_problem()
    return JSONResponse(problem, status_code=503, media_type=PROBLEM_JSON, headers={"Retry-After": str(RETRY_AFTER_S)})


def install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProblemError)
    async def _problem(_: Request, exc: ProblemError) -> JSONResponse:
        headers = getattr(exc, "headers", None)  # e.g. Retry-After on a 429
        return JSONResponse(exc.to_problem(), status_code=exc.status, media_type=PROBLEM_JSON, headers=headers)

    @app.exception_handler(StorageUnavailable)
    async def _storage(_: Request, exc: StorageUnavailable) -> JSONResponse:
        return _unavailable(f"storage is unavailable: {exc}")

    async def _broker(_: Request, exc: Exception) -> JSONResponse:
        return _unavailable(f"the job broker is unavailable: {type(exc).__name__}")

    app.add_exception_handler(redis.exceptions.RedisError, _broker)
    app.add_exception_handler(kombu.exceptions.OperationalError, _broker)  # sending a task failed

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        if any(e["type"] == "json_invalid" for e in errors):
            return problem_response(400, "Malformed JSON", "the request body is not valid JSON", "malformed-json")
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
        return problem_response(422, "Invalid input", detail, "invalid-input", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        title = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, "HTTP error")
        return problem_response(exc.status_code, title, str(exc.detail), title.lower().replace(" ", "-"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return problem_response(500, "Internal error", f"{type(exc).__name__}", "internal")


class BodySizeLimit:
    """Reject bodies over the limit with 413 before any handler reads them.

    ``Content-Length`` is checked up front; a chunked body is counted as it streams in.
    Multipart uploads get their own (larger) limit.
    """

    def __init__(self, app: ASGIApp, json_limit: int, upload_limit: int) -> None:
        self.app, self.json_limit, self.upload_limit = app, json_limit, upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        multipart = headers.get("content-type", "").startswith("multipart/")
        limit = self.upload_limit if multipart else self.json_limit
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, limit)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
            return message

        await self.app(scope, counting_receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = JSONResponse(
            PayloadTooLarge(f"the request body exceeds {limit} bytes").to_problem(),
            status_code=413,
            media_type=PROBLEM_JSON,
        )
        await response(scope, receive, send)
