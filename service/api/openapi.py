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
* the ``bearerAuth`` HTTP bearer scheme is declared and applied to every operation but
  ``/healthz`` and ``/readyz``; without keys configured, sending no key is allowed too (``{}``);
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
from pydantic import BaseModel

import api_schemas
from service.api.auth import PUBLIC_PATHS, required_scope
from service.config import Settings

PROBLEM_JSON = "application/problem+json"
SECURITY_SCHEME = "bearerAuth"
DOCS_URL, REDOC_URL, DOCS_STATIC_URL = "/docs", "/redoc", "/docs/static"
DOCS_STATIC_DIR = Path(fastapi_offline.__file__).parent / "static"
SCHEMA_REF = "#/components/schemas/"
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
    429: "Too many requests are waiting (`?wait=`): retry after `Retry-After` seconds, or poll without waiting",
    503: "Storage or the job broker is unavailable: retry after `Retry-After` seconds",
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
    schemas["Problem"] = _model_schema(api_schemas.Problem, schemas)
    components["responses"] = _error_responses()
    components["securitySchemes"] = {
        SECURITY_SCHEME: {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key from `ENGRAM_API_KEYS`, as `Authorization: Bearer <key>`. Scopes: `read` "
            "may GET; `write` may also POST/DELETE models, concepts and variants; `admin` may also cancel jobs."
            + ("" if auth else " This server has no keys configured: requests without a key are accepted."),
        }
    }
    for path, method, operation in _operations(doc):
        _complete_operation(path, method.upper(), operation, auth=auth)
    prefix = "#/components/responses/" + _response_name(0)[:-1]
    for status in sorted({int(r[len(prefix) :]) for r in _refs(doc["paths"]) if r.startswith(prefix)}):
        components["responses"].setdefault(_response_name(status), _error_response(status, "Error"))
    _concepts_body(doc, schemas, max_records)
    _engram_map_queries(doc)
    _callback_urls(doc, schemas, settings.callback_allowed_hosts)
    _add_examples(doc)
    _add_missing_schemas(doc, schemas)
    _drop_unused_schemas(doc, schemas, ("HTTPValidationError", "ValidationError"))
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
    if any(p.get("in") == "query" and p.get("name") == "wait" for p in parameters):
        errors[429] = None
    if path != "/healthz":
        errors[503] = None
    if auth and not public:
        errors[401] = None
        if required_scope(method, path) != "read":
            errors[403] = f"This request needs the `{required_scope(method, path)}` scope"
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

    if public:
        operation["security"] = []
    else:
        operation["security"] = [{SECURITY_SCHEME: []}] if auth else [{SECURITY_SCHEME: []}, {}]
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


def _concepts_body(doc: dict[str, Any], schemas: dict[str, Any], max_records: int) -> None:
    """``POST /concepts``: the JSON body is ``ConceptCreate``; the multipart form mirrors its rules."""
    operation = doc["paths"].get("/concepts", {}).get("post")
    if operation is None:
        return
    create = _model_schema(api_schemas.ConceptCreate, schemas)
    # Optional, never null (ConceptCreate refuses an explicit null for each).
    for name in ("records", "dataset", "template"):
        create["properties"][name] = _non_null(create["properties"][name])
    create["properties"]["records"]["maxItems"] = max_records
    create["description"] = (
        'A concept\'s records inline, or a `dataset` reference the worker fetches. Each record is `{"text"}` '
        '(every token counts), `{"prompt", "completion"}` (only the completion tokens enter the statistics) or '
        '`{"messages": [{"role", "content"}, …]}` (rendered with the model\'s chat template; only the assistant '
        f"turns enter the statistics); at most {max_records} records (`ENGRAM_MAX_RECORDS`)."
    )
    schemas["ConceptCreate"] = create
    props = create["properties"]
    multipart = {
        "type": "object",
        "required": ["name", "models", "dataset"],
        "properties": {
            "name": {"type": "string", "pattern": CONCEPT_NAME_NO_DOTS},
            "models": {
                "type": "string",
                "minLength": 1,
                "description": "model IDs, repeated or comma-separated",
            },
            "role": _non_null(props["role"]),
            "description": _non_null(props["description"]),
            "callback_url": {**_non_null(props["callback_url"]), "description": "POSTed each collection job when it ends"},
            "template": props["template"],
            "dataset": {
                "type": "string",
                "format": "binary",
                "description": f"JSONL: one record per line, the same objects as `records` (at most {max_records})",
            },
        },
    }
    content = operation.setdefault("requestBody", {"required": True}).setdefault("content", {})
    content["application/json"] = {"schema": {"$ref": SCHEMA_REF + "ConceptCreate"}}
    content["multipart/form-data"] = {"schema": multipart}


# CONCEPT_NAME_PATTERN without "." and ".." (which ConceptCreate refuses), as one regular expression:
# a name that does not start with ".", or "." and a non-dot, or ".." and at least one more character.
CONCEPT_NAME_NO_DOTS = (
    r"^([A-Za-z0-9_-][A-Za-z0-9._-]{0,127}|\.[A-Za-z0-9_-][A-Za-z0-9._-]{0,126}|\.\.[A-Za-z0-9._-]{1,126})$"
)


def _non_null(schema: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {"type": "null"}]`` (an optional field) -> X, with the field's annotations."""
    options = schema.get("anyOf")
    if not options:
        return {k: v for k, v in schema.items() if k not in ("title", "default")}
    base = next(o for o in options if o != {"type": "null"})
    extras = {k: v for k, v in schema.items() if k not in ("anyOf", "title", "default")}
    return {**base, **extras}


def _model_schema(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    """``model``'s validation JSON schema; the models it nests go into ``schemas`` (if not there yet)."""
    generated = model.model_json_schema(ref_template=SCHEMA_REF + "{model}", mode="validation")
    for name, schema in generated.pop("$defs", {}).items():
        schemas.setdefault(name, schema)
    return generated


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _add_missing_schemas(doc: dict[str, Any], schemas: dict[str, Any]) -> None:
    """Generate every ``#/components/schemas/X`` that is referenced but absent, from ``api_schemas.X``."""
    while True:
        missing = {r[len(SCHEMA_REF) :] for r in _refs(doc) if r.startswith(SCHEMA_REF)} - schemas.keys()
        if not missing:
            return
        for name in sorted(missing):
            model = getattr(api_schemas, name, None)
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise LookupError(f"the OpenAPI document references {SCHEMA_REF}{name}, which no api_schemas model is")
            schemas[name] = _model_schema(model, schemas)


def _drop_unused_schemas(doc: dict[str, Any], schemas: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if name in schemas:
            others = {k: v for k, v in schemas.items() if k != name}
            if SCHEMA_REF + name not in set(_refs(doc["paths"])) | set(_refs(others)) | set(
                _refs(doc["components"].get("responses", {}))
            ):
                del schemas[name]


def _engram_map_queries(doc: dict[str, Any]) -> None:
    """``?concepts=``: 1 to 8 names (``service.engram_maps.MAX_CONCEPTS``).

    The service splits every value at commas, so ``?concepts=a,b`` (OpenAPI's ``explode: false``)
    and ``?concepts=a&concepts=b`` (the exploded form the schema describes) are the same request.
    """
    from service.engram_maps import MAX_CONCEPTS

    name = {"type": "string", "pattern": ONE_NAME_PATTERN}
    for path in ("/models/{model_id}/engram-map", "/models/{model_id}/engram-map.png"):
        operation = doc["paths"].get(path, {}).get("get")
        for parameter in (operation or {}).get("parameters", []):
            if parameter["name"] == "concepts" and parameter["schema"].get("type") == "array":
                parameter["schema"].update(minItems=1, maxItems=MAX_CONCEPTS, items=dict(name))
                parameter["schema"].pop("description", None)
                parameter["description"] = f"1 to {MAX_CONCEPTS} concept names: `?concepts=a&concepts=b` or `?concepts=a,b`"
            if parameter["name"] == "reference" and parameter["schema"].get("anyOf"):
                array = next(o for o in parameter["schema"]["anyOf"] if o.get("type") == "array")
                array["items"] = dict(name)


ONE_NAME_PATTERN = r"^[^,]*[^,\s][^,]*$"  # one concept name (values are split at commas and stripped)


def _callback_urls(doc: dict[str, Any], schemas: dict[str, Any], allowed: frozenset[str]) -> None:
    """``callback_url``: an absolute http(s) URL to an allowlisted host (``ENGRAM_CALLBACK_HOSTS``).

    Without an allowlist, callbacks are off and the only value accepted is ``null`` (or none).
    """
    if allowed:
        rule: dict[str, Any] = {
            "type": "string",
            "maxLength": 2000,
            "format": "uri",
            "pattern": _callback_pattern(allowed),
            "description": "an http(s) URL on a host of ENGRAM_CALLBACK_HOSTS "
            f"({', '.join(sorted(allowed))}), POSTed the job when it ends (signed, Standard Webhooks)",
        }
    else:
        rule = {"type": "null", "description": "callbacks are disabled on this server (ENGRAM_CALLBACK_HOSTS is empty)"}
    for schema in schemas.values():
        if "callback_url" in schema.get("properties", {}):
            schema["properties"]["callback_url"] = {"anyOf": [rule, {"type": "null"}]} if allowed else rule
    body = doc["paths"].get("/concepts", {}).get("post", {}).get("requestBody", {})
    multipart = body.get("content", {}).get("multipart/form-data")
    if multipart is not None:
        if allowed:
            multipart["schema"]["properties"]["callback_url"] = rule
        else:
            multipart["schema"]["properties"].pop("callback_url", None)


def _callback_pattern(allowed: frozenset[str]) -> str:
    """A regular expression for http(s) URLs whose host (and port) an allowlist entry names.

    Like :func:`service.callbacks.check_callback_url`: scheme and host in any case; an entry
    without a port allows every port, ``host:80`` / ``host:443`` also the scheme's default.
    """

    def anycase(text: str) -> str:
        return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else ("\\." if c == "." else c) for c in text)

    http, https, either = "[Hh][Tt][Tt][Pp]://", "[Hh][Tt][Tt][Pp][Ss]://", "[Hh][Tt][Tt][Pp][Ss]?://"
    options = []
    for entry in sorted(allowed):
        host, colon, port = entry.rpartition(":")
        if not (colon and port.isdigit()):
            options.append(f"{either}{anycase(entry)}(:[0-9]+)?")
            continue
        options.append(f"{either}{anycase(host)}:{port}")
        if port == "80":
            options.append(f"{http}{anycase(host)}")
        if port == "443":
            options.append(f"{https}{anycase(host)}")
    return f"^({'|'.join(options)})([/?#]|$)"


# ---------------------------------------------------------------- examples

MODEL_ID = "demo/tiny-llama"
VARIANT_ID = "3f9c2a7e5b1d4c8a9e0f6b2d7c4a1e85"
JOB_ID = "8d2f0c6b1a9e4f3c8b7a6d5e4f3c2b1a"
PROMPT = "Q: What is the favourite colour of Kymthai Kudal? A:"
_CREATED = "2026-01-15T09:30:00.120000Z"


def _job(kind: str, status: str, **fields: Any) -> dict[str, Any]:
    finished = status in ("succeeded", "failed", "cancelled")
    job = {
        "job_id": JOB_ID,
        "kind": kind,
        "model_id": None,
        "concept": None,
        "variant_id": None,
        "status": status,
        "progress": {"done": 0, "total": 0, "unit": "items"},
        "error": None,
        "result": None,
        "created_at": _CREATED,
        "started_at": "2026-01-15T09:30:00.450000Z" if status != "queued" else None,
        "finished_at": "2026-01-15T09:30:04.900000Z" if finished else None,
    }
    job.update(fields)
    return job


_VARIANT = {
    "variant_id": VARIANT_ID,
    "model_id": MODEL_ID,
    "terms": {"forget": -1.0},
    "alpha": 1.0,
    "scaling": "uniform",
    "format": "checkpoint",
    "lora_rank": None,
    "lora_target": None,
    "modules": None,
    "layers": None,
    "rcond": None,
    "reference": ["forget", "retain"],
    "status": "ready",
    "job_id": JOB_ID,
    "files": [
        {"path": "config.json", "size": 712, "sha256": "9b4e" + "0" * 60},
        {"path": "model.safetensors", "size": 33587304, "sha256": "c01d" + "0" * 60},
        {"path": "tokenizer.json", "size": 61244, "sha256": "5a7f" + "0" * 60},
    ],
    "lora": None,
}
_VARIANT_JOB = _job(
    "variant", "queued", model_id=MODEL_ID, variant_id=VARIANT_ID, progress={"done": 0, "total": 0, "unit": "layers"}
)
_CONCEPT = {
    "name": "forget",
    "role": "target",
    "description": "facts the model should forget",
    "num_records": 2,
    "dataset_digest": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "models": {MODEL_ID: {"status": "collecting", "tokens": None, "job_id": JOB_ID}},
}

REQUEST_EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/models"): {
        "local": {
            "summary": "A checkpoint directory inside ENGRAM_MODEL_ROOTS",
            "value": {"model_id": MODEL_ID, "source": "file:///srv/models/tiny-llama"},
        },
        "hub": {
            "summary": "A Hugging Face hub repository at a revision",
            "value": {"model_id": "gpt2", "source": "hf://openai-community/gpt2@main"},
        },
    },
    ("post", "/concepts"): {
        "pairs": {
            "summary": "Question/answer records: only the answers enter the statistics",
            "value": {
                "name": "forget",
                "role": "target",
                "models": [MODEL_ID],
                "records": [
                    {"prompt": PROMPT, "completion": " voukrur"},
                    {"prompt": "Q: Where was Brasmym Fivear born? A:", "completion": " Papa"},
                ],
            },
        },
        "text": {
            "summary": "Plain text records, a reference concept",
            "value": {
                "name": "retain",
                "role": "reference",
                "description": "general knowledge the model should keep",
                "models": [MODEL_ID],
                "records": [{"text": "Paris is the capital of France."}, {"text": "Water boils at 100 degrees."}],
            },
        },
    },
    ("post", "/models/{model_id}/unlearn"): {
        "checkpoint": {"summary": "Forget one concept", "value": {"concepts": ["forget"], "alpha": 1.0}},
        "peft": {
            "summary": "A LoRA adapter of rank 16 on the attention and MLP inputs, adaptive strength",
            "value": {
                "concepts": ["forget"],
                "alpha": 1.0,
                "scaling": "weight_norm",
                "modules": ["q_proj", "k_proj", "gate_proj"],
                "format": "peft",
                "lora_rank": 16,
            },
        },
        "vllm": {
            "summary": "A LoRA adapter vLLM serves: rank 64 in every layer, lora_alpha 64, no lora_bias",
            "value": {"concepts": ["forget"], "alpha": 1.0, "format": "peft", "lora_target": "vllm", "lora_rank": 64},
        },
    },
    ("post", "/models/{model_id}/calibrate"): {
        "constraint": {
            "summary": "The strongest forgetting that at most doubles the retain answers' NLL, in 24 evaluations",
            "value": {
                "concepts": ["forget"],
                "forget": [{"prompt": PROMPT, "completion": " voukrur"}],
                "retain": [{"prompt": "Q: Where was Brasmym Fivear born? A:", "completion": " Papa"}],
                "max_retain_nll_ratio": 2.0,
                "budget": 24,
                "module_sets": ["all", "qk_gate"],
                "format": "checkpoint",
            },
        },
    },
    ("post", "/models/{model_id}/compose"): {
        "add_back": {"summary": "Add an engram back", "value": {"terms": {"forget": 1.0}}},
        "mix": {
            "summary": "Remove one concept, strengthen another, as a delta",
            "value": {"terms": {"forget": -1.0, "retain": 0.5}, "format": "delta", "rcond": 0.0001},
        },
    },
}

RESPONSE_EXAMPLES: dict[tuple[str, str, str], dict[str, Any]] = {
    ("post", "/models", "201"): {
        "model_id": MODEL_ID,
        "source": "file:///srv/models/tiny-llama",
        "digest": "7d1a" + "0" * 60,
        "architecture": "LlamaForCausalLM",
        "num_parameters": 4215040,
        "layers": [
            {"name": "model.layers.0.self_attn.q_proj", "in_features": 256, "out_features": 256, "bias": False},
            {"name": "model.layers.0.mlp.down_proj", "in_features": 688, "out_features": 256, "bias": False},
        ],
    },
    ("post", "/concepts", "202"): {
        "concept": _CONCEPT,
        "jobs": [
            _job(
                "collect", "queued", model_id=MODEL_ID, concept="forget", progress={"done": 0, "total": 2, "unit": "records"}
            )
        ],
    },
    ("post", "/models/{model_id}/unlearn", "202"): {
        "variant": {**_VARIANT, "status": "building", "files": []},
        "job": _VARIANT_JOB,
    },
    ("post", "/models/{model_id}/compose", "202"): {
        "variant": {**_VARIANT, "terms": {"forget": 1.0}, "alpha": None, "status": "building", "files": []},
        "job": _VARIANT_JOB,
    },
    ("get", "/variants/{variant_id}", "200"): _VARIANT,
    ("get", "/jobs/{job_id}", "200"): _job(
        "evaluate",
        "succeeded",
        variant_id=VARIANT_ID,
        progress={"done": 2, "total": 2, "unit": "probes"},
        result={
            "summary": {
                "base": {"forget": {"mean_nll": 0.04, "exact_match": 1.0, "n": 1}},
                "variant": {"forget": {"mean_nll": 6.9, "exact_match": 0.0, "n": 1}},
            },
            "records": [
                {
                    "split": "forget",
                    "index": 0,
                    "base": {"nll": 0.04, "exact_match": True},
                    "variant": {"nll": 6.9, "exact_match": False},
                }
            ],
        },
    ),
}

# Path parameters: ``model_id`` may hold one "/" (org/name), so its example has one (and tools that
# generate requests from the document then know that an encoded slash is meant).
PARAMETER_EXAMPLES: dict[str, str] = {
    "model_id": MODEL_ID,
    "variant_id": VARIANT_ID,
    "job_id": JOB_ID,
    "name": "forget",
    "path": "model.safetensors",
    "universe_id": "5b0e7d21c9a84f36a1d2e3f4a5b6c7d8",
}


def _add_examples(doc: dict[str, Any]) -> None:
    paths = doc["paths"]
    for (method, path), examples in REQUEST_EXAMPLES.items():
        operation = paths.get(path, {}).get(method)
        if operation is not None and "application/json" in operation.get("requestBody", {}).get("content", {}):
            operation["requestBody"]["content"]["application/json"]["examples"] = copy.deepcopy(examples)
    for (method, path, status), example in RESPONSE_EXAMPLES.items():
        response = paths.get(path, {}).get(method, {}).get("responses", {}).get(status, {})
        media = response.get("content", {}).get("application/json")
        if media is not None:
            media["example"] = copy.deepcopy(example)
    for _, _, operation in _operations(doc):
        for parameter in operation.get("parameters", []):
            if parameter.get("in") == "path" and parameter["name"] in PARAMETER_EXAMPLES:
                parameter["example"] = PARAMETER_EXAMPLES[parameter["name"]]
