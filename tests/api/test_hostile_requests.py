"""Hostile requests (issue 11): each answers a 4xx problem+json and stores nothing, never a 500.

One app for the module, called in this process (``tests.helpers.app``; ``ENGRAM_MAX_RECORDS=50``,
so the record limit is cheap to hit), with the tiny model registered, two concepts collected and one
variant built to download from (by its job process, as a server's). Every refused request runs
inside ``unchanged``: listings and the files in storage stay the same. The tests that need no
variant are in the fast tier.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import wait_concepts_ready, wait_variant_ready
from service.concepts.service import dataset_bytes
from service.engine.records import Record
from tests.helpers.api import assert_problem, jsonl, register_model, unchanged
from tests.helpers.app import InProcessServer, in_process_server

MODEL = "hostile/tiny"
MAX_RECORDS = 50
FACTS = make_facts(40, seed=1)
RECORDS = [{"prompt": p, "completion": c} for p, c in FACTS]
HUGE = "9" * 5000  # beyond Python's 4300-digit int() limit


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[InProcessServer]:
    root = tmp_path_factory.mktemp("hostile")
    with in_process_server(root, model_root, ENGRAM_MAX_RECORDS=str(MAX_RECORDS)) as app:
        yield app


@pytest.fixture(scope="module")
def variant(server: InProcessServer, tiny_llama_dir: Path) -> dict[str, Any]:
    """A ready variant of ``hostile/tiny`` (concepts h-forget, target, and h-retain, reference)."""
    api = server.client
    register_model(api, MODEL, f"file://{tiny_llama_dir}", existing_ok=True)
    for name, records, role in (("h-forget", RECORDS[:4], "target"), ("h-retain", RECORDS[4:16], "reference")):
        response = api.post("/concepts", json={"name": name, "models": [MODEL], "records": records, "role": role})
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["h-forget", "h-retain"], MODEL)
    response = api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["h-forget"], "reference": ["h-forget", "h-retain"]})
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(api, response.json()["variant"]["variant_id"])


def post_json(api: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return api.post(path, content=raw, headers={"content-type": "application/json"})


def upload(api: httpx.Client, name: str, data: bytes, **fields: str) -> httpx.Response:
    form = {"name": name, "models": MODEL, **fields}
    return api.post("/concepts", data=form, files={"dataset": ("d.jsonl", data, "application/x-ndjson")})


# ---------------------------------------------------------------- lone surrogates

LONE = r"\ud800"  # as it travels: a JSON escape for half of a UTF-16 surrogate pair


def concept(**fields: Any) -> dict[str, Any]:
    return {"name": "surrogate", "models": [MODEL], "records": [{"text": "a"}], **fields}


SURROGATE_BODIES = [  # "@" becomes the lone surrogate
    ("record-text", "/concepts", concept(records=[{"text": "a@b"}]), "records.0.text"),
    ("record-prompt", "/concepts", concept(records=[{"prompt": "@", "completion": "c"}]), "records.0.prompt"),
    ("record-completion", "/concepts", concept(records=[{"prompt": "p", "completion": "x@"}]), "records.0.completion"),
    ("record-key", "/concepts", concept(records=[{"te@xt": "a"}]), "records.0"),
    ("concept-name", "/concepts", concept(name="s@"), "name"),
    ("concept-description", "/concepts", concept(description="@"), "description"),
    ("model-id", "/models", {"model_id": "x/y@", "source": "file:///nowhere"}, "model_id"),
    ("model-source", "/models", {"model_id": "x/z", "source": "file:///models/@"}, "source"),
    (
        "evaluate-probe",
        "/variants/{vid}/evaluate",
        {"forget": [{"prompt": "Q: @ A:", "completion": " a"}]},
        "forget.0.prompt",
    ),
    ("generate-prompt", "/variants/{vid}/generate", {"prompt": "Q:@", "max_new_tokens": 2}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "field"), [pytest.param(*c[1:], id=c[0]) for c in SURROGATE_BODIES])
def test_lone_surrogate_in_a_json_field_is_422_naming_it(
    server: InProcessServer, variant: dict[str, Any], path: str, body: dict[str, Any], field: str
) -> None:
    with unchanged(server):
        raw = json.dumps(body).replace("@", LONE).encode()
        response = post_json(server.client, path.format(vid=variant["variant_id"]), raw)
        problem = assert_problem(response, 422, field, "surrogate")
    assert problem["errors"][0]["loc"][0] == "body"


@pytest.mark.fast
@pytest.mark.parametrize("where", ["prompt", "completion"])
def test_lone_surrogate_in_an_uploaded_record_is_422_naming_line_and_field(server: InProcessServer, where: str) -> None:
    record = {"prompt": "p", "completion": "c", where: f"x{LONE}y"}
    data = jsonl(RECORDS[:2]) + json.dumps(record).replace("\\\\", "\\").encode() + b"\n"
    assert LONE.encode() in data
    with unchanged(server):
        assert_problem(upload(server.client, "surrogate-upload", data), 422, "line 3", f"'{where}'", "surrogate")


# ---------------------------------------------------------------- deeply nested JSON


@pytest.mark.fast
@pytest.mark.parametrize(
    ("path", "raw"),
    [
        pytest.param("/concepts", b"[" * 100_000, id="concepts-array"),
        pytest.param("/concepts", b'{"name": "n", "models": ["m"], "records": ' + b"[" * 100_000, id="concepts-records"),
        pytest.param("/concepts", b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, id="concepts-objects"),
        pytest.param("/models", b"[" * 100_000 + b"]" * 100_000, id="models"),
    ],
)
def test_deeply_nested_json_is_4xx(server: InProcessServer, path: str, raw: bytes) -> None:
    with unchanged(server):
        response = post_json(server.client, path, raw)
        assert 400 <= response.status_code < 500, response.text
        assert_problem(response, response.status_code)


# ---------------------------------------------------------------- Range, HEAD, 405


def file_url(variant: dict[str, Any]) -> tuple[str, int]:
    entry = max(variant["files"], key=lambda f: f["size"])
    return f"/variants/{variant['variant_id']}/files/{entry['path']}", int(entry["size"])


@pytest.mark.parametrize(
    ("header", "status", "span"),
    [
        pytest.param(f"bytes={HUGE}-", 416, None, id="first-pos-huge"),
        pytest.param(f"bytes={HUGE}-{HUGE}", 416, None, id="both-huge"),
        pytest.param(f"bytes=0-{HUGE}", 206, "all", id="last-pos-huge-is-clamped"),
        pytest.param(f"bytes=-{HUGE}", 206, "all", id="suffix-huge-is-the-whole-file"),
        pytest.param(f"bytes={'0' * 5000}2-5", 206, (2, 5), id="leading-zeros"),
        pytest.param("bytes=2-5", 206, (2, 5), id="plain"),
        pytest.param("bytes=0-1,5-6", 200, "all", id="multi-range-ignored"),
        pytest.param("items=0-1", 200, "all", id="other-unit-ignored"),
        pytest.param("bytes=abc", 200, "all", id="unparsable-ignored"),
        pytest.param("bytes=5-2", 200, "all", id="last-before-first-ignored"),
        pytest.param("bytes=-", 200, "all", id="empty-ignored"),
    ],
)
def test_range_header(server: InProcessServer, variant: dict[str, Any], header: str, status: int, span: Any) -> None:
    url, size = file_url(variant)
    whole = server.client.get(url)
    assert whole.status_code == 200 and len(whole.content) == size
    response = server.client.get(url, headers={"Range": header})
    assert response.status_code == status, response.text[:300]
    if status == 416:
        assert_problem(response, 416)
        assert response.headers["content-range"] == f"bytes */{size}"
        return
    first, last = (0, size - 1) if span == "all" else span
    assert response.content == whole.content[first : last + 1]
    assert response.headers["content-length"] == str(last - first + 1)
    if status == 206:
        assert response.headers["content-range"] == f"bytes {first}-{last}/{size}"
    else:
        assert "content-range" not in response.headers


def test_unsatisfiable_range_is_416_with_the_size(server: InProcessServer, variant: dict[str, Any]) -> None:
    url, size = file_url(variant)
    for header in (f"bytes={size}-", f"bytes={size}-{size + 10}", "bytes=-0"):
        response = server.client.get(url, headers={"Range": header})
        assert_problem(response, 416)
        assert response.headers["content-range"] == f"bytes */{size}", header


def test_head_on_a_file_gives_the_headers_without_a_body(server: InProcessServer, variant: dict[str, Any]) -> None:
    url, size = file_url(variant)
    get = server.client.get(url)
    head = server.client.head(url)
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == str(size)
    assert head.headers["etag"] == get.headers["etag"]
    assert head.headers["accept-ranges"] == "bytes"
    ranged = server.client.head(url, headers={"Range": "bytes=1-3"})
    assert ranged.status_code == 206
    assert ranged.headers["content-range"] == f"bytes 1-3/{size}"
    assert ranged.headers["content-length"] == "3"
    assert server.client.head(f"/variants/{variant['variant_id']}/files/nope.bin").status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/variants/{vid}/files/config.json", {"GET", "HEAD"}),
        ("DELETE", "/models", {"GET", "POST"}),
        ("PATCH", "/concepts/h-forget", {"GET", "DELETE"}),
        ("OPTIONS", "/models/org/model/calibrate", {"POST"}),  # not GET: the model route's path holds slashes
        ("PUT", "/models/org/model/unlearn", {"POST"}),
    ],
)
def test_405_names_the_allowed_methods(
    server: InProcessServer, variant: dict[str, Any], method: str, path: str, allowed: set[str]
) -> None:
    with unchanged(server):
        response = server.client.request(method, path.format(vid=variant["variant_id"]))
        assert_problem(response, 405)
        assert {m.strip() for m in response.headers["allow"].split(",")} >= allowed
        if path.startswith("/models/"):  # the action's own methods only, as the API documents them
            assert {m.strip() for m in response.headers["allow"].split(",")} == allowed
        assert response.json()["detail"].startswith(f"{method} /") and "serves" in response.json()["detail"]


@pytest.mark.fast
@pytest.mark.parametrize("path", ["/api/models", "/v1/concepts", "/variant/abc"])
def test_an_unknown_route_is_a_404_that_says_so(server: InProcessServer, path: str) -> None:
    """Not the bare "Not Found" of the framework: the route, and where the routes are listed."""
    response = server.client.get(path)
    assert_problem(response, 404)
    detail = response.json()["detail"]
    assert path in detail and "/docs" in detail, detail


# ---------------------------------------------------------------- concept names and roles


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_names_are_refused(server: InProcessServer, variant: dict[str, Any], name: str) -> None:
    with unchanged(server):
        body = {"name": name, "models": [MODEL], "records": RECORDS[:2]}
        assert_problem(server.client.post("/concepts", json=body), 422, "name")
        assert_problem(upload(server.client, name, jsonl(RECORDS[:2])), 422, "name")


def test_reposting_a_concept_with_another_role_is_409(server: InProcessServer, variant: dict[str, Any]) -> None:
    api = server.client
    stored = api.get("/concepts/h-retain").json()
    with unchanged(server):
        body = {"name": "h-retain", "models": [MODEL], "records": RECORDS[4:16], "role": "target"}
        assert_problem(api.post("/concepts", json=body), 409, "h-retain", "'reference'", "'target'")
        form = upload(api, "h-retain", jsonl(RECORDS[4:16]), role="target")
        assert_problem(form, 409, "'reference'", "'target'")
    assert api.get("/concepts/h-retain").json() == stored


def test_reposting_without_a_role_keeps_it(server: InProcessServer, variant: dict[str, Any]) -> None:
    api = server.client
    before = api.get("/concepts/h-retain").json()
    again = api.post("/concepts", json={"name": "h-retain", "models": [MODEL], "records": RECORDS[4:16]})
    assert again.status_code == 202, again.text
    assert again.json()["concept"]["role"] == "reference"
    body = {"name": "h-retain", "models": [MODEL], "records": RECORDS[4:16], "role": "reference"}
    assert api.post("/concepts", json=body).status_code == 202
    assert api.get("/concepts/h-retain").json() == before


# ---------------------------------------------------------------- uploads


def test_upload_over_the_record_limit_is_413_and_stores_nothing(server: InProcessServer, variant: dict[str, Any]) -> None:
    many = [{"text": f"record number {i} " + "x" * 200} for i in range(40_000)]  # ~9 MB, 800x the limit
    with unchanged(server):
        response = upload(server.client, "too-many", jsonl(many))
        assert_problem(response, 413, str(MAX_RECORDS), "ENGRAM_MAX_RECORDS")
        as_json = server.client.post("/concepts", json={"name": "too-many", "models": [MODEL], "records": many[:51]})
        assert_problem(as_json, 413, str(MAX_RECORDS), "ENGRAM_MAX_RECORDS")
    assert server.client.get("/concepts/too-many").status_code == 404


def test_upload_at_the_record_limit_is_accepted(server: InProcessServer, variant: dict[str, Any]) -> None:
    records = [{"text": f"exactly at the limit {i}"} for i in range(MAX_RECORDS)]
    response = upload(server.client, "at-limit", jsonl(records))
    assert response.status_code == 202, response.text
    assert response.json()["concept"]["num_records"] == MAX_RECORDS


@pytest.mark.parametrize(
    ("line", "status", "mentions"),
    [
        pytest.param(b'{"prompt": "broken', 400, ("line 3", "not valid JSON"), id="not-json"),
        pytest.param(b'{"prompt": "no completion"}', 422, ("line 3", "completion"), id="not-a-record"),
        pytest.param(b"[" * 100_000, 400, ("line 3",), id="nested"),
        pytest.param(b'{"text": "\xff\xfe"}', 400, ("line 3", "UTF-8"), id="not-utf8"),
    ],
)
def test_upload_with_an_invalid_line_names_it_and_stores_nothing(
    server: InProcessServer, variant: dict[str, Any], line: bytes, status: int, mentions: tuple[str, ...]
) -> None:
    data = jsonl(RECORDS[:2]) + line + b"\n" + jsonl(RECORDS[2:4])
    with unchanged(server):
        assert_problem(upload(server.client, "broken-line", data), status, *mentions)


def test_upload_without_its_closing_boundary_is_400(server: InProcessServer, variant: dict[str, Any]) -> None:
    boundary = "b0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\ncut\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="models"\r\n\r\n{MODEL}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="dataset"; filename="d.jsonl"\r\n\r\n'
    ).encode() + jsonl(RECORDS[:3])
    with unchanged(server):
        response = server.client.post(
            "/concepts", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}"}
        )
        assert_problem(response, 400, "closing boundary")


def test_uploaded_dataset_has_the_digest_of_the_same_records_posted_as_json(
    server: InProcessServer, variant: dict[str, Any]
) -> None:
    # Non-ASCII text, and characters str.splitlines() would cut a stored line at (U+2028, U+0085, U+001C).
    records = [
        {"prompt": "Q: Où est né Kymthai? A:", "completion": " à Zürich 🙂"},
        {"text": "line\u2028separator, next\u0085line and file\u001cseparator"},
        *RECORDS[20:24],
    ]
    expected = hashlib.sha256(dataset_bytes([Record.from_mapping(r, i) for i, r in enumerate(records)])).hexdigest()
    # CRLF line ends, a byte-order mark, blank lines, other key order and escapes than the stored form.
    lines = [json.dumps(dict(reversed(list(r.items()))), ensure_ascii=True).encode() for r in records]
    data = b"\xef\xbb\xbf" + b"\r\n".join(lines[:2]) + b"\r\n\r\n  \n" + b"\n".join(lines[2:])  # no final newline
    uploaded = upload(server.client, "digest-upload", data, role="reference")
    assert uploaded.status_code == 202, uploaded.text
    posted = server.client.post(
        "/concepts", json={"name": "digest-json", "models": [MODEL], "records": records, "role": "reference"}
    )
    assert posted.status_code == 202, posted.text
    assert uploaded.json()["concept"]["dataset_digest"] == posted.json()["concept"]["dataset_digest"] == expected
    assert uploaded.json()["concept"]["num_records"] == len(records)
    stored = server.storage_dir / "datasets" / f"{expected}.jsonl"
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == expected
    # The stored lines read back as the same records: collection succeeds.
    wait_concepts_ready(server.client, ["digest-upload"], MODEL)
