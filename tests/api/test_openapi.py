"""The OpenAPI document and the interactive docs.

The document the live server serves (no API keys) and the one of an app with keys configured
(a server of this module's own) must be valid OpenAPI 3.1, resolve
every ``$ref``, declare every error as problem+json, carry the bearer scheme, the validation rules
and the examples. ``/docs`` and ``/redoc`` must work offline: only local assets, all served.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import OpenAPIV31SpecValidator
from pydantic import ValidationError

from api_schemas import ConceptCreate
from engram_fixtures.live import LiveServer, start_server, stop_server
from service.api.auth import PUBLIC_PATHS, required_scope
from service.api.openapi import READ_KEY_REFUSALS
from service.config import Settings
from service.errors import InvalidInput
from service.jobs.callbacks import check_callback_url

PROBLEM_JSON = "application/problem+json"
PROBLEM_REF = "#/components/schemas/Problem"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
ADMIN_KEY = "openapi-test-admin-key-0123456789"
CALLBACK_HOSTS = "hooks.example.com,127.0.0.1:8443"


@pytest.fixture(scope="module")
def document(live_server: LiveServer) -> dict[str, Any]:
    """The document as the session's server (no keys) serves it."""
    response = live_server.client.get("/openapi.json")
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server of this module's own with keys, a small ``ENGRAM_MAX_RECORDS`` and callback hosts."""
    root = tmp_path_factory.mktemp("openapi-keyed")
    (root / "models").mkdir()
    server = start_server(
        root / "store",
        root / "models",
        root / "server.log",
        ENGRAM_API_KEYS=f"{ADMIN_KEY}:admin",
        ENGRAM_MAX_RECORDS="5000",
        ENGRAM_CALLBACK_HOSTS=CALLBACK_HOSTS,
        ENGRAM_CALLBACK_SECRET="openapi-test-callback-secret",
    )
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def keyed_document(keyed_server: LiveServer) -> dict[str, Any]:
    response = keyed_server.client.get("/openapi.json", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                yield path, method.upper(), item[method]


def resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """Follow ``$ref`` (local JSON pointers) until a non-reference object."""
    seen = 0
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        target: Any = doc
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            assert isinstance(target, dict) and part in target, f"{ref} does not resolve"
            target = target[part]
        node = target
        seen += 1
        assert seen < 20, f"reference loop at {ref}"
    return node


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


# ---------------------------------------------------------------- validity


@pytest.mark.parametrize("which", ["document", "keyed_document"])
def test_document_is_valid_openapi_3_1(which: str, request: pytest.FixtureRequest) -> None:
    doc = request.getfixturevalue(which)
    assert doc["openapi"].startswith("3.1.")
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in OpenAPIV31SpecValidator(doc).iter_errors()]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("which", ["document", "keyed_document"])
def test_every_ref_resolves(which: str, request: pytest.FixtureRequest) -> None:
    doc = request.getfixturevalue(which)
    all_refs = set(refs(doc))
    assert "#/components/schemas/ConceptCreate" in all_refs  # the hand-written one of POST /concepts
    for ref in sorted(all_refs):
        resolve(doc, {"$ref": ref})
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # 422 is a Problem, not FastAPI's shape
    assert {"ConceptCreate", "Problem"} <= schemas.keys()


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("which", ["document", "keyed_document"])
def test_every_error_is_problem_json(which: str, request: pytest.FixtureRequest) -> None:
    doc = request.getfixturevalue(which)
    for path, method, operation in operations(doc):
        where = f"{method} {path}"
        statuses = {int(s): resolve(doc, r) for s, r in operation["responses"].items()}
        errors = {s: r for s, r in statuses.items() if s >= 400}
        if path != "/healthz":
            assert 503 in errors, where
        for status, response in errors.items():
            assert response["description"], (where, status)
            assert list(response.get("content", {})) == [PROBLEM_JSON], (where, status)
            assert response["content"][PROBLEM_JSON]["schema"] == {"$ref": PROBLEM_REF}, (where, status)
        parameters = operation.get("parameters", [])
        if "requestBody" in operation:
            assert {400, 413, 422} <= errors.keys(), where
        if any(p["in"] == "path" for p in parameters):
            assert 404 in errors, where
        if any(p["in"] == "query" and p["name"] == "wait" for p in parameters):
            assert 429 in errors, where
            assert errors[429]["headers"]["Retry-After"]["required"] is True, where
        if 503 in errors:
            assert "Retry-After" in errors[503]["headers"], where
    problem = doc["components"]["schemas"]["Problem"]
    assert {"type", "title", "status", "detail"} <= set(problem["required"])
    assert "errors" in problem["properties"]


def test_route_specific_statuses(document: dict[str, Any]) -> None:
    paths = document["paths"]
    assert {"200", "201", "409"} <= paths["/models"]["post"]["responses"].keys()
    assert {"404", "409", "415"} <= paths["/concepts"]["post"]["responses"].keys()
    assert {"200", "202", "409"} <= paths["/models/{model_id}/unlearn"]["post"]["responses"].keys()
    download = paths["/variants/{variant_id}/files/{path}"]["get"]["responses"]
    assert {"200", "206", "307", "416"} <= download.keys()
    assert list(download["200"]["content"]) == ["application/octet-stream"]
    assert list(paths["/models/{model_id}/engram-map.png"]["get"]["responses"]["200"]["content"]) == ["image/png"]
    assert "content" not in paths["/concepts/{name}"]["delete"]["responses"]["204"]
    assert {"200", "202", "429"} <= paths["/variants/{variant_id}/evaluate"]["post"]["responses"].keys()


# ---------------------------------------------------------------- success bodies

SCHEMAS = "#/components/schemas/"


def json_successes(doc: dict[str, Any]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """``(METHOD, path, status, schema)`` of every 2xx answer with a JSON body."""
    for path, method, operation in operations(doc):
        for status, answer in operation["responses"].items():
            schema = answer.get("content", {}).get("application/json", {}).get("schema")
            if status.startswith("2") and schema is not None:
                yield method, path, status, schema


def test_every_json_success_body_is_a_named_schema(document: dict[str, Any]) -> None:
    """A client (and docs/API.md) can say what every JSON answer holds: a component schema, or a list of one."""
    untyped = [
        f"{method} {path} {status}: {schema}"
        for method, path, status, schema in json_successes(document)
        if "$ref" not in schema and "$ref" not in schema.get("items", {})
    ]
    assert untyped == []
    ok = {(method, path): schema for method, path, status, schema in json_successes(document) if status == "200"}
    assert ok[("GET", "/healthz")] == {"$ref": SCHEMAS + "Health"}
    assert ok[("GET", "/readyz")] == {"$ref": SCHEMAS + "Readiness"}
    assert ok[("GET", "/models/{model_id}/engram-map")] == {"$ref": SCHEMAS + "EngramMap"}


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probes_answer_what_their_schema_says(path: str, live_server: LiveServer, document: dict[str, Any]) -> None:
    response = live_server.client.get(path)
    assert response.status_code == 200, response.text
    schema = document["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    body = response.json()
    jsonschema.Draft202012Validator({**schema, "components": document["components"]}).validate(body)
    fields = resolve(document, schema)["properties"].keys()
    assert body.keys() <= fields, f"{path} answers fields its schema does not name"


# ---------------------------------------------------------------- security


def test_security_without_keys_is_not_declared(document: dict[str, Any]) -> None:
    """No ENGRAM_API_KEYS: no scheme and no requirement, so Swagger UI shows no lock (issue 28)."""
    assert "securitySchemes" not in document["components"]
    for path, method, operation in operations(document):
        assert operation["security"] == [], (method, path)
        assert "401" not in operation["responses"], (method, path)  # a server without keys never says 401


def test_security_with_keys_is_required(keyed_document: dict[str, Any]) -> None:
    scheme = keyed_document["components"]["securitySchemes"]["bearerAuth"]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    protected = 0
    for path, method, operation in operations(keyed_document):
        responses = operation["responses"]
        if path in PUBLIC_PATHS:
            assert operation["security"] == [], (method, path)
            assert "401" not in responses and "403" not in responses
            continue
        protected += 1
        assert operation["security"] == [{"bearerAuth": []}], (method, path)
        assert "401" in responses, (method, path)
        refused = required_scope(method, path) != "read" or (method, path) in READ_KEY_REFUSALS  # a read key's new map
        assert ("403" in responses) == refused, (method, path)
        challenge = resolve(keyed_document, responses["401"])["headers"]["WWW-Authenticate"]
        assert challenge["required"] is True
    assert protected >= 20


# ---------------------------------------------------------------- validation rules and examples


def test_validation_rules_are_schema_constraints(document: dict[str, Any], keyed_document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    create = schemas["ConceptCreate"]["properties"]
    assert create["name"]["pattern"] == r"^[A-Za-z0-9._-]{1,128}$"
    assert create["name"]["not"] == {"enum": [".", ".."]}
    assert create["records"]["minItems"] == 1
    assert create["records"]["maxItems"] == Settings().max_records  # the session server's default
    assert keyed_document["components"]["schemas"]["ConceptCreate"]["properties"]["records"]["maxItems"] == 5000
    # {"text"}, {"prompt", "completion"}, {"messages"}, ShareGPT {"conversations"}, Alpaca {"instruction", "output"},
    # an image {"image", "label"?}
    assert len(create["records"]["items"]["oneOf"]) == 6
    assert create["dataset"]["$ref"].endswith("/DatasetReference") and create["template"]["const"] == "chat"
    multipart = document["paths"]["/concepts"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    names = [".", "..", "...", ".a", "..a", "a.", "-", "a" * 128, "a" * 129, "." + "a" * 127, "a b", "", "é"]
    for name in names:  # the form's one pattern (no `not`) refuses exactly what ConceptCreate refuses
        try:
            ConceptCreate(name=name, models=["m"], records=[{"text": "x"}])
            valid = True
        except ValidationError:
            valid = False
        assert bool(re.search(multipart["properties"]["name"]["pattern"], name)) == valid, name
    assert multipart["properties"]["role"]["enum"] == ["target", "reference"]
    assert schemas["ModelCreate"]["properties"]["source"]["pattern"]
    unlearn = schemas["UnlearnRequest"]["properties"]
    assert unlearn["alpha"]["exclusiveMinimum"] == 0 and unlearn["alpha"]["maximum"] == 100
    options = schemas["ComposeRequest"]["properties"]
    assert options["layers"]["anyOf"][0]["items"]["minimum"] == 0
    assert options["rcond"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "exclusiveMaximum": 1.0}
    assert options["lora_rank"]["anyOf"][0]["minimum"] == 1
    coefficient = options["terms"]["additionalProperties"]
    assert coefficient["exclusiveMaximum"] == 1e6 and coefficient["not"] == {"const": 0}
    assert "anyOf" in schemas["EvaluateRequest"]  # at least one forget or retain probe
    assert schemas["UnlearnRequest"]["then"]["properties"]["format"] == {"const": "peft"}  # lora_rank: peft only
    concepts = next(
        p for p in document["paths"]["/models/{model_id}/engram-map"]["get"]["parameters"] if p["name"] == "concepts"
    )
    assert (concepts["schema"]["minItems"], concepts["schema"]["maxItems"]) == (1, 8)


def test_callback_url_follows_the_allowlist(document: dict[str, Any], keyed_document: dict[str, Any]) -> None:
    """No ENGRAM_CALLBACK_HOSTS: only null. With hosts: the pattern accepts what the service accepts."""
    for name in ("ConceptCreate", "UnlearnRequest", "ComposeRequest", "EvaluateRequest", "GenerateRequest"):
        assert document["components"]["schemas"][name]["properties"]["callback_url"]["type"] == "null", name
    multipart = document["paths"]["/concepts"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert "callback_url" not in multipart["properties"]
    rule = keyed_document["components"]["schemas"]["GenerateRequest"]["properties"]["callback_url"]["anyOf"][0]
    settings = Settings(callback_hosts=CALLBACK_HOSTS, callback_secret="x" * 20)
    urls = [
        "http://hooks.example.com/cb",
        "HTTPS://Hooks.Example.COM:9000/cb?x=1",
        "https://127.0.0.1:8443/",
        "http://127.0.0.1:8443",
        "http://127.0.0.1/cb",
        "http://127.0.0.1:8444/cb",
        "http://user@hooks.example.com/",
        "ftp://hooks.example.com/",
        "http://hooks.example.com.evil.test/",
        "http://evil.test/?hooks.example.com",
    ]
    for url in urls:
        try:
            check_callback_url(url, settings)
            accepted = True
        except InvalidInput:
            accepted = False
        assert bool(re.search(rule["pattern"], url)) == accepted, url


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A validator of ``schema`` whose ``#/components/...`` references resolve in ``doc``."""
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def test_examples_match_their_schemas(document: dict[str, Any]) -> None:
    checked = set()
    for path, method, operation in operations(document):
        for media in operation.get("requestBody", {}).get("content", {}).values():
            for name, example in media.get("examples", {}).items():
                _validator(document, media["schema"]).validate(example["value"])
                checked.add((method, path, name))
        for status, response in operation["responses"].items():
            for media in resolve(document, response).get("content", {}).values():
                if "example" in media:
                    _validator(document, media["schema"]).validate(media["example"])
                    checked.add((method, path, status))
    wanted = {
        ("POST", "/models"),
        ("POST", "/concepts"),
        ("POST", "/models/{model_id}/unlearn"),
        ("POST", "/models/{model_id}/compose"),
        ("GET", "/variants/{variant_id}"),
        ("GET", "/jobs/{job_id}"),
    }
    assert wanted <= {(m, p) for m, p, _ in checked}


# ---------------------------------------------------------------- /docs and /redoc, offline


class _Assets(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href", "spec-url") and value:
                self.urls.append(value)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_use_only_local_assets(page: str, live_server: LiveServer) -> None:
    api = live_server.client
    response = api.get(page)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/html")
    assert not re.search(r"(https?:)?//[A-Za-z0-9]", response.text), "the page names a remote URL"
    parser = _Assets()
    parser.feed(response.text)
    scripts = [u for u in parser.urls if u.endswith(".js")]
    assert scripts, parser.urls
    for url in parser.urls:
        assert url.startswith("/"), url
        asset = api.get(url)
        assert asset.status_code == 200, (url, asset.status_code)
        assert asset.content, url
    for url in scripts:
        asset = api.get(url)
        assert "javascript" in asset.headers["content-type"], url
        assert len(asset.content) > 100_000, url  # the real bundle, not a stub


def test_docs_assets_follow_auth(keyed_server: LiveServer) -> None:
    """With keys, the assets are ``read`` like ``/docs`` itself: 401 problem+json without a key."""
    api = keyed_server.client
    for url in ("/docs", "/redoc", "/docs/static/redoc.standalone.js", "/docs/static/swagger-ui-bundle.js"):
        refused = api.get(url)
        assert refused.status_code == 401, (url, refused.status_code)
        assert refused.headers["content-type"].startswith(PROBLEM_JSON)
        served = api.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert served.status_code == 200 and served.content, url


def test_openapi_json_is_served_as_built(live_server: LiveServer, document: dict[str, Any]) -> None:
    again = httpx.get(f"{live_server.base_url}/openapi.json", timeout=30).json()
    assert again == document
