"""Every error as application/problem+json; request-size limits and the text check of JSON bodies,
which apply before any route parses a body."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import anyio.to_thread
import kombu.exceptions
import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.json_cost import check_json_values
from service.api.request_errors import validation_problem
from service.errors import InvalidInput, PayloadTooLarge, ProblemError, ServiceUnavailable
from service.storage.base import StorageUnavailable

log = logging.getLogger("engram.api")
PROBLEM_JSON = "application/problem+json"


def problem_response(
    status: int, title: str, detail: str, slug: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    body = {"type": f"https://engram.dev/problems/{slug}", "title": title, "status": status, "detail": detail}
    body.update({k: v for k, v in extra.items() if v is not None})
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


RETRY_AFTER_S = 5  # a dependency that went away usually comes back within seconds (restart, failover)


def _unavailable(detail: str) -> JSONResponse:
    """503 with ``Retry-After``, so clients back off instead of hammering a recovering service."""
    problem = ServiceUnavailable(detail).to_problem().model_dump(mode="json")
    return JSONResponse(problem, status_code=503, media_type=PROBLEM_JSON, headers={"Retry-After": str(RETRY_AFTER_S)})


def install_problem_handlers(app: FastAPI, max_json_values: int | None = None) -> None:
    # added first, so innermost: inside auth and the size limit
    app.add_middleware(JsonBodyCheck, max_values=max_json_values)

    @app.exception_handler(ProblemError)
    async def _problem(_: Request, exc: ProblemError) -> JSONResponse:
        return JSONResponse(
            exc.to_problem().model_dump(mode="json"), status_code=exc.status, media_type=PROBLEM_JSON, headers=exc.headers
        )

    @app.exception_handler(StorageUnavailable)
    async def _storage(_: Request, exc: StorageUnavailable) -> JSONResponse:
        return _unavailable(f"storage is unavailable: {exc}")

    async def _broker(_: Request, exc: Exception) -> JSONResponse:
        return _unavailable(f"the job broker is unavailable: {type(exc).__name__}")

    app.add_exception_handler(redis.exceptions.RedisError, _broker)
    app.add_exception_handler(kombu.exceptions.OperationalError, _broker)  # sending a task failed

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        problem = validation_problem(request, exc)  # the fix named: service/api/request_errors.py
        return JSONResponse(
            problem.to_problem().model_dump(mode="json"), status_code=problem.status, media_type=PROBLEM_JSON
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        title = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, "HTTP error")
        slug = title.lower().replace(" ", "-")
        headers = dict(exc.headers or {})
        detail = str(exc.detail)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 405:  # RFC 9110 §15.5.6: Allow lists what the resource supports
            headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
            if detail == "Method Not Allowed":  # Starlette's own words: say what the path serves
                detail = f"{where}: this path serves {headers['Allow'] or 'no method'}"
        elif exc.status_code == 404 and detail == "Not Found":  # no route matched (not an unknown resource)
            detail = f"no route {where}; the API's routes are listed at /docs and /openapi.json"
        return problem_response(exc.status_code, title, detail, slug, headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return problem_response(500, "Internal error", f"{type(exc).__name__}", "internal")


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _allowed_methods(request: Request) -> str:
    """Every method the API serves at this path, as its OpenAPI document says (Starlette's 405 names
    only those of the first route that matched the path).

    Model IDs hold slashes, so ``GET /models/{model_id}`` also matches ``/models/x/calibrate``: only
    the most specific documented paths that match (the most literal characters) count, ``Allow: POST``
    there. A path the document does not describe falls back to the routes that match it.
    """
    documented = _documented_methods(request)
    if documented is not None:
        return ", ".join(m for m in _METHODS if m in documented)
    allowed = [
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in request.app.router.routes)
    ]
    return ", ".join(allowed)


def _documented_methods(request: Request) -> set[str] | None:
    best, methods = -1, set[str]()
    for template, operations in request.app.openapi().get("paths", {}).items():
        pattern = "^" + re.sub(r"\\\{[^}]*\\\}", "[^?]+", re.escape(template)) + "$"
        if not re.match(pattern, request.url.path):
            continue
        literal = len(re.sub(r"\{[^}]*\}", "", template))
        declared = {m.upper() for m in operations if m.upper() in _METHODS}
        if literal > best:
            best, methods = literal, declared
        elif literal == best:
            methods |= declared
    if best < 0:
        return None
    return methods | ({"HEAD"} if "GET" in methods else set())  # Starlette answers HEAD wherever GET is served


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
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}  # never fails
        multipart = headers.get("content-type", "").startswith("multipart/")
        limit = self.upload_limit if multipart else self.json_limit
        setting = "ENGRAM_MAX_UPLOAD_BYTES" if multipart else "ENGRAM_MAX_JSON_BYTES"
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, limit, setting)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise PayloadTooLarge(f"the request body exceeds {limit} bytes (the limit, {setting})")
            return message

        await self.app(scope, counting_receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, limit: int, setting: str) -> None:
        response = JSONResponse(
            PayloadTooLarge(f"the request body exceeds {limit} bytes (the limit, {setting})")
            .to_problem()
            .model_dump(mode="json"),
            status_code=413,
            media_type=PROBLEM_JSON,
        )
        await response(scope, receive, send)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON's \ud800-\udfff: half of a UTF-16 pair
_JSON_TYPE = re.compile(r"^application/(?:[\w.+-]*\+)?json\b", re.IGNORECASE)
_THREAD_ABOVE_BYTES = 1 << 20


class JsonBodyCheck:
    """Read a JSON request body whole before the route does, and refuse one whose strings are not text.

    ``json.loads`` turns ``"\\ud800"`` (half of a UTF-16 surrogate pair) into a one-character string
    that no UTF-8 file, tokenizer or response can hold: a model ID, a description or a probe with
    one used to end in a 500 wherever it was first encoded. The raw body is searched for such an
    escape (cheap); only a body that has one is decoded (in a thread when large), and a lone
    surrogate in any string or key is a 422 that names the field, before any route runs.

    Reading the body here also turns a body-size limit hit while it streams into its 413 (routes
    that let FastAPI read the body would report a 400), and lets what the body will cost once decoded
    be checked before anything decodes it: past ``max_values`` JSON values it is a 413
    (:mod:`service.api.json_cost`). Multipart and other bodies pass untouched.
    """

    def __init__(self, app: ASGIApp, max_values: int | None = None) -> None:
        self.app, self.max_values = app, max_values

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        try:
            while more:
                message = await receive()
                if message["type"] != "http.request":  # the client went away: nothing to answer
                    return
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
        except ProblemError as exc:  # BodySizeLimit's 413
            await _answer(exc, scope, receive, send)
            return
        body = b"".join(chunks)
        del chunks  # the body once in memory, not twice, while the route runs
        problem = await self._too_many_values(body, scope["path"])
        if problem is None and _SURROGATE_ESCAPE.search(body):
            problem = await _lone_surrogate(body)
        if problem is not None:
            await _answer(problem, scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_many_values(self, body: bytes, path: str) -> ProblemError | None:
        if self.max_values is None:
            return None
        try:
            if len(body) > _THREAD_ABOVE_BYTES:  # an exact count takes up to ~0.1 s per MiB
                await anyio.to_thread.run_sync(check_json_values, body, self.max_values, path)
            else:
                check_json_values(body, self.max_values, path)
        except ProblemError as exc:
            return exc
        return None


async def _answer(problem: ProblemError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(problem.to_problem().model_dump(mode="json"), status_code=problem.status, media_type=PROBLEM_JSON)(
        scope, receive, send
    )


def _is_json(scope: Scope) -> bool:
    if scope["method"] in {"GET", "HEAD", "OPTIONS"}:
        return False
    content_type = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"content-type"), "")
    return not content_type or bool(_JSON_TYPE.match(content_type))  # FastAPI reads an untyped body as JSON


async def _lone_surrogate(body: bytes) -> InvalidInput | None:
    """The 422 naming the first string or key of ``body`` that holds a lone surrogate, if any."""
    if len(body) > _THREAD_ABOVE_BYTES:
        return await anyio.to_thread.run_sync(_find_lone_surrogate, body)
    return _find_lone_surrogate(body)


def _find_lone_surrogate(body: bytes) -> InvalidInput | None:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # not JSON at all: the route says so
        return None
    stack: list[tuple[tuple[str | int, ...], Any]] = [(("body",), document)]
    while stack:  # depth-first, in document order, without recursion
        path, value = stack.pop()
        if isinstance(value, str):
            bad = _surrogate_in(value)
            if bad is not None:
                return _surrogate_problem(path, bad, "string")
        elif isinstance(value, dict):
            for key in value:
                bad = _surrogate_in(key)
                if bad is not None:
                    return _surrogate_problem((*path, key.encode("utf-8", "backslashreplace").decode()), bad, "key")
            stack.extend(((*path, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
    return None


def _surrogate_in(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"\\u{ord(text[exc.start]):04x}"
    return None


def _surrogate_problem(path: tuple[str | int, ...], escape: str, what: str) -> InvalidInput:
    loc = ".".join(str(p) for p in path)
    msg = f"the {what} holds a lone surrogate ({escape}): not Unicode text"
    return InvalidInput(f"{loc}: {msg}", errors=[{"loc": list(path), "msg": msg, "type": "string_unicode"}])
