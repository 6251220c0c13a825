"""The OpenAPI document, complete and valid (3.1), and the interactive docs served from local assets.

FastAPI derives paths, parameters, bodies and success schemas from the routes. What it cannot see
is added here, once, when the document is first asked for:

* every schema a hand-written ``$ref`` names (``ConceptCreate`` from the multipart/JSON body of
  ``POST /concepts``) is generated from its pydantic model in :mod:`api_schemas`;
* every operation declares the errors it can answer, as ``application/problem+json`` with the
  ``Problem`` schema. Most are derived from the route itself: a request body may be malformed (400),
  too large (413) or invalid (422); a path parameter may name nothing (404); a ``wait`` query
  parameter may be refused while too many requests wait (429, ``Retry-After``); storage or the
  broker may be away (503, ``Retry-After``); with ``ENGRAM_API_KEYS`` set, every route but the
  probes may answer 401, and 403 where it needs more than the ``read`` scope
  (:func:`service.api.auth.required_scope` decides, as it does for requests). What only a route's
  body knows (a 409 conflict, a 415, a 416) is listed in :data:`EXTRA_RESPONSES`, or declared on
  the route (``responses={409: {"description": ...}}``): either way it becomes problem+json;
* the 422 is the Problem with ``errors`` (see :mod:`service.api.problems`), not FastAPI's
  ``HTTPValidationError``;
* with ``ENGRAM_API_KEYS`` set, the ``bearerAuth`` HTTP bearer scheme is declared and applied to
  every operation but ``/healthz`` and ``/readyz``; without keys, no scheme is declared and every
  operation's ``security`` is ``[]`` (Swagger UI shows no lock where no key is needed);
* limits that depend on settings appear as schema constraints (``ENGRAM_MAX_RECORDS``; a
  ``callback_url`` must name a host of ``ENGRAM_CALLBACK_HOSTS``, and is ``null`` when that is
  empty), and the main routes carry examples.

The document is built from the settings of the process serving it, so it describes that server.

Swagger UI (``/docs``) and ReDoc (``/redoc``) load their JavaScript and CSS from ``/docs/static``,
files shipped by the ``fastapi-offline`` package: the pages work without internet access. Auth
treats those files like any other ``GET`` (``read`` scope).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

import api_schemas
from service.api.auth import PUBLIC_PATHS, required_scope
from service.api.openapi_examples import add_examples
from service.api.openapi_schemas import (
    SCHEMA_REF,
    add_missing_schemas,
    callback_urls,
    concepts_body,
    drop_unused_schemas,
    engram_map_queries,
    model_schema,
    refs,
)
from service.config import Settings

PROBLEM_JSON = "application/problem+json"
SECURITY_SCHEME = "bearerAuth"
DOCS_URL, REDOC_URL, DOCS_STATIC_URL = "/docs", "/redoc", "/docs/static"
DOCS_STATIC_DIR = Path(fastapi_offline.__file__).parent / "static"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

_RETRY_AFTER = {
    "description": "seconds to wait before trying again",
    "schema": {"type": "integer", "minimum": 0},
}
_WWW_AUTHENTICATE = {
    "description": 'the Bearer challenge (RFC 6750), e.g. `Bearer realm="engram-service", error="invalid_token"`',
    "schema": {"type": "string"},
}

# What each error status means when the route does not say more.
ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Malformed request body (not valid JSON, or a multipart upload that cannot be read)",
    401: "No valid API key: send `Authorization: Bearer <key>`",
    403: "The API key's scope is too small for this request",
    404: "Not found",
    409: "Conflict with the current state",
    413: "The request body exceeds the size limit",
    415: "Unsupported media type",
    416: "Range not satisfiable",
    422: "Invalid input: `errors` lists each invalid field (`loc`, `msg`, `type`)",
    429: "Too many requests are waiting (`?wait=`), or the request would start a job past "
    "ENGRAM_MAX_QUEUED_JOBS_PER_KEY or ENGRAM_MAX_QUEUED_JOBS (nothing was submitted): retry after "
    "`Retry-After` seconds",
    503: "Storage or the job broker is unavailable: retry after `Retry-After` seconds",
}

# GETs that a read key may not make in full: they would start work, which only write keys may.
READ_KEY_REFUSALS: dict[tuple[str, str], str] = {
    ("GET", path): "A read key asked for a map not computed yet: a write or admin key's same request computes it"
    for path in ("/models/{model_id}/engram-map", "/models/{model_id}/engram-map.png")
}

# Statuses only the handler's code knows: (METHOD, path) -> {status: description}.
EXTRA_RESPONSES: dict[tuple[str, str], dict[int, str]] = {
    ("GET", "/readyz"): {
        503: "Not ready: storage or the job broker is unavailable, or (distributed mode) no worker with a live "
        "heartbeat consumes one of the queues (the detail names it)"
    },
    ("POST", "/models"): {409: "The model ID is already registered with another source"},
    ("POST", "/concepts"): {
        404: "A listed model is not registered",
        409: "The concept exists with other records: delete it first or use another name",
        415: "The body is neither `application/json` nor `multipart/form-data`",
    },
    ("POST", "/models/{model_id}/unlearn"): {409: "A concept has no ready statistics on this model"},
    ("POST", "/models/{model_id}/compose"): {409: "A concept has no ready statistics on this model"},
    ("POST", "/models/{model_id}/universes"): {409: "A concept (or every one) has no ready statistics on this model"},
    ("POST", "/models/{model_id}/calibrate"): {
        409: "A concept has no ready statistics on this model (or lacks a layer the edit space needs), or the "
        "universe would not fit ENGRAM_UNIVERSE_BYTES_BUDGET"
    },
    ("GET", "/models/{model_id}/engram-map"): {409: "A concept has no ready statistics on this model"},
    ("GET", "/models/{model_id}/engram-map.png"): {409: "A concept has no ready statistics on this model"},
    ("POST", "/variants/{variant_id}/evaluate"): {409: "The variant is not ready (still building, or failed)"},
    ("POST", "/variants/{variant_id}/generate"): {409: "The variant is not ready (still building, or failed)"},
    ("GET", "/variants"): {404: "`model_id` names a model that is not registered"},
    ("GET", "/variants/{variant_id}/files/{path}"): {416: "The `Range` starts beyond the end of the file"},
    ("HEAD", "/variants/{variant_id}/files/{path}"): {416: "The `Range` starts beyond the end of the file"},
}

# Success statuses a handler sets itself (FastAPI documents only the decorator's status_code).
EXTRA_SUCCESS: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("POST", "/models"): {"200": {"description": "The identical registration existed already"}},
    ("POST", "/models/{model_id}/unlearn"): {"200": {"description": "The variant exists already (ready)"}},
    ("POST", "/models/{model_id}/compose"): {"200": {"description": "The variant exists already (ready)"}},
    ("POST", "/models/{model_id}/universes"): {"200": {"description": "The universe exists already (ready)"}},
    ("POST", "/models/{model_id}/calibrate"): {"200": {"description": "The same calibration was answered already"}},
    ("POST", "/variants/{variant_id}/evaluate"): {"200": {"description": "The job finished within `wait` seconds"}},
    ("POST", "/variants/{variant_id}/generate"): {"200": {"description": "The job finished within `wait` seconds"}},
}
_SUCCESS_DESCRIPTIONS: dict[tuple[str, str], dict[str, str]] = {
    ("POST", "/models"): {"201": "Registered"},
    ("POST", "/concepts"): {"202": "Stored; a collection job per listed model that lacks statistics"},
    ("POST", "/models/{model_id}/unlearn"): {"202": "The variant is building: poll it, or its job"},
    ("POST", "/models/{model_id}/compose"): {"202": "The variant is building: poll it, or its job"},
    ("POST", "/models/{model_id}/universes"): {"202": "The universe is building: poll it, or its job"},
    ("POST", "/models/{model_id}/calibrate"): {"202": "The calibration job is queued or running: poll `GET /jobs/{job_id}`"},
    ("POST", "/variants/{variant_id}/evaluate"): {"202": "The job is queued or running: poll `GET /jobs/{job_id}`"},
    ("POST", "/variants/{variant_id}/generate"): {"202": "The job is queued or running: poll `GET /jobs/{job_id}`"},
    ("DELETE", "/concepts/{name}"): {"204": "Deleted"},
}

_BINARY = {"schema": {"type": "string", "format": "binary"}}


# ---------------------------------------------------------------- wiring


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Replace ``app.openapi`` with the completed document; serve ``/docs`` and ``/redoc`` offline.

    ``app`` must be created with ``docs_url=None, redoc_url=None`` (FastAPI's own pages load
    their assets from a CDN).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    install_docs(app)


def install_docs(app: FastAPI) -> None:
    """Swagger UI at ``/docs`` and ReDoc at ``/redoc``, their assets under ``/docs/static``."""
    app.mount(DOCS_STATIC_URL, StaticFiles(directory=DOCS_STATIC_DIR), name="docs-static")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{DOCS_STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_STATIC_URL}/favicon.png",
            swagger_ui_parameters={"persistAuthorization": True, **(app.swagger_ui_parameters or {})},
        )

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_STATIC_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_STATIC_URL}/favicon.png",
            with_google_fonts=False,
        )


# ---------------------------------------------------------------- the document


def build_openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """FastAPI's document for ``app``, completed (see the module docstring).

    Args:
        app: the application (its routes, title, version, description).
        settings: what the document depends on: ``ENGRAM_API_KEYS`` (set: 401/403 are declared and
            a key is required), ``ENGRAM_MAX_RECORDS`` and ``ENGRAM_CALLBACK_HOSTS``.
    """
    auth, max_records = settings.api_keys is not None, settings.max_records
    doc = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
        servers=app.servers,
        separate_input_output_schemas=app.separate_input_output_schemas,
    )
    doc = copy.deepcopy(doc)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["Problem"] = model_schema(api_schemas.Problem, schemas)
    components["responses"] = _error_responses()
    if auth:  # without keys no scheme is declared: Swagger UI would show a lock on every route
        components["securitySchemes"] = {
            SECURITY_SCHEME: {
                "type": "http",
                "scheme": "bearer",
                "description": "An API key from `ENGRAM_API_KEYS`, as `Authorization: Bearer <key>`. Scopes: `read` "
                "may GET; `write` may also POST/DELETE models, concepts and variants; `admin` may also cancel jobs.",
            }
        }
    for path, method, operation in _operations(doc):
        _complete_operation(path, method.upper(), operation, auth=auth)
    prefix = "#/components/responses/" + _response_name(0)[:-1]
    for status in sorted({int(r[len(prefix) :]) for r in refs(doc["paths"]) if r.startswith(prefix)}):
        components["responses"].setdefault(_response_name(status), _error_response(status, "Error"))
    concepts_body(doc, schemas, max_records)
    engram_map_queries(doc)
    callback_urls(doc, schemas, settings.callback_allowed_hosts)
    add_examples(doc)
    add_missing_schemas(doc, schemas)
    # JobResult: a client's reading of Job.result, which the document leaves out (SkipJsonSchema) but
    # pydantic still lists among the definitions.
    drop_unused_schemas(doc, schemas, ("HTTPValidationError", "ValidationError", "JobResult"))
    return doc


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                yield path, method, item[method]


def _error_responses() -> dict[str, Any]:
    """Reusable ``components.responses``: one per error status, problem+json."""
    return {_response_name(status): _error_response(status, text) for status, text in ERROR_DESCRIPTIONS.items()}


def _error_response(status: int, description: str) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {PROBLEM_JSON: {"schema": {"$ref": SCHEMA_REF + "Problem"}}},
    }
    if status in (429, 503):
        response["headers"] = {"Retry-After": {**_RETRY_AFTER, "required": status == 429}}
    if status in (401, 403):
        response["headers"] = {"WWW-Authenticate": {**_WWW_AUTHENTICATE, "required": True}}
    if status == 416:
        response["headers"] = {
            "Content-Range": {
                "description": "`bytes */size`: the file's length",
                "schema": {"type": "string", "pattern": r"^bytes \*/\d+$"},
            }
        }
    return response


def _response_name(status: int) -> str:
    return f"Problem{status}"


def _complete_operation(path: str, method: str, operation: dict[str, Any], *, auth: bool) -> None:
    key = (method, path)
    responses: dict[str, Any] = operation.setdefault("responses", {})
    for status, description in _SUCCESS_DESCRIPTIONS.get(key, {}).items():
        if status in responses:
            responses[status]["description"] = description
    for status, extra in EXTRA_SUCCESS.get(key, {}).items():
        if status not in responses:
            template: dict[str, Any] = next(
                (r for s, r in sorted(responses.items()) if s.startswith("2") and "content" in r), {}
            )
            responses[status] = {**copy.deepcopy(template), **extra}
    _media_types(path, method, responses)

    public = path in PUBLIC_PATHS
    parameters = operation.get("parameters", [])
    has_body = "requestBody" in operation
    errors: dict[int, str | None] = {}
    if has_body:
        errors.update({400: None, 413: None, 422: None})
    if parameters:
        errors[422] = None
    if any(p.get("in") == "path" for p in parameters):
        errors[404] = None
    if method == "POST" or any(p.get("in") == "query" and p.get("name") == "wait" for p in parameters):
        errors[429] = None  # every POST may start a job: admission control (service.jobs.admission)
    if path != "/healthz":
        errors[503] = None
    if auth and not public:
        errors[401] = None
        if required_scope(method, path) != "read":
            errors[403] = f"This request needs the `{required_scope(method, path)}` scope"
        elif key in READ_KEY_REFUSALS:
            errors[403] = READ_KEY_REFUSALS[key]
    errors.update(EXTRA_RESPONSES.get(key, {}))
    responses.pop("422", None)  # FastAPI's HTTPValidationError: the Problem below replaces it
    for status_text, declared in list(responses.items()):  # a route's own `responses=` errors: problem+json
        if status_text.isdigit() and int(status_text) >= 400 and "$ref" not in declared:
            errors.setdefault(int(status_text), declared.get("description") or None)
    for code in sorted(errors):
        error_description = errors[code]
        ref = {"$ref": "#/components/responses/" + _response_name(code)}
        if error_description is None:
            responses[str(code)] = ref
        else:  # a Reference Object may override the description in 3.1
            responses[str(code)] = {**ref, "description": error_description}
    operation["responses"] = dict(sorted(responses.items()))

    if public or not auth:  # `[]`: no key needed (a server without ENGRAM_API_KEYS accepts every request)
        operation["security"] = []
    else:
        operation["security"] = [{SECURITY_SCHEME: []}]
        scope = required_scope(method, path)
        note = f"Needs an API key with the `{scope}` scope when `ENGRAM_API_KEYS` is set."
        operation["description"] = f"{operation.get('description', '').rstrip()}\n\n{note}".lstrip()


def _media_types(path: str, method: str, responses: dict[str, Any]) -> None:
    """Success bodies FastAPI cannot type: file bytes, the Prometheus text format, 204, 307."""
    if path == "/variants/{variant_id}/files/{path}" and method in ("GET", "HEAD"):
        body = {"content": {"application/octet-stream": _BINARY}} if method == "GET" else {}
        etag = {"description": "the file's SHA-256, quoted", "schema": {"type": "string"}}
        responses["200"] = {
            "description": "The file's bytes" if method == "GET" else "The headers a GET answers with, no body",
            "headers": {"ETag": etag, "Accept-Ranges": {"schema": {"type": "string", "enum": ["bytes"]}}},
            **body,
        }
        responses["206"] = {
            "description": "The requested byte range (`Range: bytes=a-b`, `a-` or `-n`)",
            "headers": {
                "Content-Range": {
                    "description": "`bytes start-end/size`",
                    "required": True,
                    "schema": {"type": "string", "pattern": r"^bytes \d+-\d+/\d+$"},
                },
                "ETag": etag,
            },
            **body,
        }
        if method == "GET":
            responses["307"] = {
                "description": "With `ENGRAM_PRESIGN_DOWNLOADS` on S3: a short-lived presigned URL to the bytes",
                "headers": {"Location": {"required": True, "schema": {"type": "string", "format": "uri"}}},
            }
    elif (method, path) == ("GET", "/metrics"):
        responses["200"] = {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    elif (method, path) == ("GET", "/models/{model_id}/engram-map.png"):
        responses["200"] = {"description": "One heatmap panel per concept", "content": {"image/png": _BINARY}}
    for status in ("204",):
        if status in responses:
            responses[status].pop("content", None)
