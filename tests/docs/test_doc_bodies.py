"""The request bodies and data files the docs show are ones the service accepts.

* Every ``curl … -d '<json>'`` of a shell example (README and docs/) validates against the
  api_schemas model of the route it is sent to (read from the routers, so a renamed or removed
  field, or a body sent to a route that has no JSON body, fails here).
* A ```json block is a request body: the ``<!-- body of: METHOD /route -->`` marker before it
  names the route, and it validates against that route's model.
* Every line of a ```jsonl block goes through the upload's own reader (``JsonlFeed`` into a
  ``DatasetSpool``, as ``POST /concepts`` reads a ``dataset`` part): a record shape the service
  refuses fails here.

The walk-throughs (tests/docs/test_docs_walkthrough.py) send the same bodies to a live server; this
module checks every one of them, also those of pages no walk-through runs, in a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.datasets.spool import DatasetSpool, JsonlFeed
from tests.helpers.doc_examples import (
    JSON_BODY,
    JSONL,
    REPO,
    CurlRequest,
    Example,
    curl_requests,
    doc_pages,
    of_kind,
    request_model,
    shell_blocks,
)

PAGES = [REPO / "README.md", *doc_pages()]
REQUESTS = [request for example in shell_blocks(PAGES) for request in curl_requests(example)]


def test_the_docs_send_json_bodies_to_the_routes_that_take_them() -> None:
    """The extraction itself: the walk-through's register, unlearn and calibrate bodies are found."""
    routes = {(r.method, r.path) for r in REQUESTS}
    assert ("POST", "/models") in routes
    assert ("POST", "/models/demo/tiny-llama/unlearn") in routes
    assert ("POST", "/models/demo/tiny-llama/calibrate") in routes


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: f"{r.example.where} {r.method} {r.path}")
def test_a_curl_body_validates_against_its_routes_request_model(request_: CurlRequest) -> None:
    model = request_model(request_.method, request_.path)
    assert model is not None, f"{request_.example.where}: no route takes a JSON body at {request_.method} {request_.path}"
    try:
        model.model_validate(request_.body)
    except ValidationError as exc:
        where = f"{request_.example.where}: the body of {request_.method} {request_.path}"
        pytest.fail(f"{where} is not a {model.__name__}:\n{exc}")


JSON_BLOCKS = of_kind(JSON_BODY)


def test_every_json_block_is_the_body_of_the_route_its_marker_names() -> None:
    """One test over all of them (there may be none: the inventory counts them either way)."""
    for example in JSON_BLOCKS:
        _check_json_block(example)


def _check_json_block(example: Example) -> None:
    assert example.body_of, f"{example.where}: a ```json block needs <!-- body of: METHOD /route --> before it"
    method, _, path = example.body_of.partition(" ")
    model = request_model(method, path)
    assert model is not None, f"{example.where}: no route takes a JSON body at {example.body_of}"
    model.model_validate(json.loads(example.code))


JSONL_BLOCKS = of_kind(JSONL)


def test_the_data_formats_page_shows_jsonl_records() -> None:
    assert any(e.page.name == "data-formats.md" for e in JSONL_BLOCKS), "the JSONL examples of data-formats.md are gone"


@pytest.mark.parametrize("example", JSONL_BLOCKS, ids=lambda e: e.where)
def test_every_line_of_a_jsonl_block_is_a_record_the_upload_reader_takes(example: Example, tmp_path: Path) -> None:
    lines = [line for line in example.code.splitlines() if line.strip()]
    with DatasetSpool(tmp_path / "dataset.jsonl", max_records=1000) as spool:
        feed = JsonlFeed(spool)
        feed.feed(example.code.encode())
        spooled = feed.finish()
    assert spooled.num_records == len(lines), f"{example.where}: {spooled.num_records} records read from {len(lines)} lines"
