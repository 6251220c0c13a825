"""Every route as helpful as /concepts (issue 40): each operation of the OpenAPI document that takes a
JSON body is sent each mistake a newcomer makes, and each answer names the fix.

* the JSON without its content-type (curl's ``-d`` alone sends a form's): 415 naming the header;
* a JSON syntax error: 400 with the line and column;
* a misspelt field (two letters swapped): 422 with "did you mean" and the right name;
* a misspelt model ID: 404 with "did you mean" and ``GET /models``.

The operations are read from the live document, so a route added later is walked too.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.helpers.api import assert_problem, register_model
from tests.helpers.app import InProcessServer

pytestmark = pytest.mark.fast

MODEL = "errors/tiny-llama"


def json_operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, body schema) of every operation with a JSON request body."""
    found = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            content = operation.get("requestBody", {}).get("content", {})
            if "application/json" in content:
                found.append((method.upper(), path, content["application/json"]["schema"]))
    return found


def concrete(path: str) -> str:
    """The path with every parameter filled (validation of the body comes before any lookup)."""
    return re.sub(r"\{[^}]+\}", "x", path)


def resolved(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].split("/")[-1]]
    return schema


def misspelt(name: str) -> str:
    """Two letters swapped in the middle (``alpha`` -> ``alhpa``)."""
    middle = len(name) // 2
    return name[: middle - 1] + name[middle] + name[middle - 1] + name[middle + 1 :] if len(name) > 3 else name + "x"


@pytest.fixture(scope="module")
def operations(app_server: InProcessServer) -> list[tuple[str, str, dict[str, Any]]]:
    document = app_server.client.get("/openapi.json").json()
    found = [(m, p, resolved(document, s)) for m, p, s in json_operations(document)]
    assert len(found) >= 8, found  # the register, concept, unlearn, evaluate, calibrate, map ... routes
    return found


def test_json_without_its_content_type_names_the_header_on_every_route(
    app_server: InProcessServer, operations: list[tuple[str, str, dict[str, Any]]]
) -> None:
    for method, path, _ in operations:
        response = app_server.client.request(
            method, concrete(path), content=b'{"a": 1}', headers={"content-type": "application/x-www-form-urlencoded"}
        )
        assert_problem(response, 415, "application/json")


def test_a_json_syntax_error_gives_its_line_and_column_on_every_route(
    app_server: InProcessServer, operations: list[tuple[str, str, dict[str, Any]]]
) -> None:
    for method, path, _ in operations:
        body = b'{\n  "concepts": ["a",]\n}'
        response = app_server.client.request(
            method, concrete(path), content=body, headers={"content-type": "application/json"}
        )
        assert_problem(response, 400, "not valid JSON", "line 2 column")


def test_a_misspelt_field_gets_the_right_name_on_every_route(
    app_server: InProcessServer, operations: list[tuple[str, str, dict[str, Any]]]
) -> None:
    checked = 0
    for method, path, schema in operations:
        names = [n for n in schema.get("properties", {}) if len(n) >= 5]
        if schema.get("additionalProperties", True) is not False or not names:
            continue  # a body that takes any field has no misspelling to catch
        name = names[0]
        wrong = misspelt(name)
        response = app_server.client.request(method, concrete(path), json={wrong: 1})
        problem = assert_problem(response, 422, f"unknown field '{wrong}': did you mean '{name}'")
        # keyed by where the field is: body.<name> (FastAPI's place), or <name> where the route parses the body
        [(where, close)] = problem["close_matches"].items()
        assert where.split(".")[-1] == wrong and close[0] == name, problem
        checked += 1
    assert checked >= 5, f"only {checked} operations forbid extra fields"


def test_a_misspelt_nested_field_gets_the_right_name(app_server: InProcessServer) -> None:
    body = {"forget": [{"prompt": "Q", "completion": "A"}], "attacks": [{"kind": "quantize", "tpye": "Q4_1"}]}
    response = app_server.client.post("/variants/x/evaluate", json=body)
    problem = assert_problem(response, 422, "unknown field 'tpye': did you mean 'type'")
    assert any(e["loc"][-1] == "tpye" for e in problem["errors"]), problem


def test_a_misspelt_choice_gets_the_allowed_value(app_server: InProcessServer) -> None:
    response = app_server.client.post(f"/models/{MODEL}/unlearn", json={"concepts": ["a"], "scaling": "weight_nrom"})
    assert_problem(response, 422, "did you mean 'weight_norm'")


def test_a_misspelt_model_id_gets_the_registered_one_and_where_to_list_them(
    app_server: InProcessServer, tiny_llama_dir: Any
) -> None:
    register_model(app_server.client, MODEL, f"file://{tiny_llama_dir}")
    wrong = MODEL.replace("llama", "lama")
    for method, path, body in (
        ("GET", f"/models/{wrong}", None),
        ("POST", f"/models/{wrong}/unlearn", {"concepts": ["a"]}),
    ):
        response = app_server.client.request(method, path, json=body)
        # the session's server holds other modules' models too: the registered one comes first
        problem = assert_problem(response, 404, f"model {wrong} is not registered (did you mean {MODEL}", "GET /models")
        assert problem["close_matches"][wrong][0] == MODEL, problem


def test_the_answers_are_the_same_shape_as_before(app_server: InProcessServer) -> None:
    """The status, title and type a client may switch on are unchanged: 400 Malformed JSON, 422 Invalid input."""
    syntax = app_server.client.post(f"/models/{MODEL}/unlearn", content=b"{", headers={"content-type": "application/json"})
    assert (syntax.json()["title"], syntax.json()["type"].rsplit("/", 1)[-1]) == ("Malformed JSON", "malformed-json")
    invalid = app_server.client.post(f"/models/{MODEL}/unlearn", json={"concepts": "a"})
    problem = json.loads(invalid.text)
    assert (problem["title"], problem["type"].rsplit("/", 1)[-1]) == ("Invalid input", "invalid-input")
    assert problem["errors"][0]["loc"] == ["body", "concepts"]
