"""Concept datasets in the shapes users have them, through a real server: uploads and ``file://`` references.

One server for the module (embedded mode, file storage) with a small ``ENGRAM_MAX_LENGTH`` (so that
truncation is cheap to reach) and small byte limits (so that a gzip bomb is cheap to send). The
shapes the README promises (JSONL with a BOM, Windows line endings, blank lines, gzip-compressed
JSONL, Parquet of several row groups with a column mapping) give exactly the dataset of the same
records posted inline; the shapes it does not read (a JSON array, CSV, TSV, plain text, Parquet or
another archive sent as an upload) are a 4xx problem that says what the dataset is and what to send
instead, and change nothing. Truncation at ``max_length`` is stated in the collection job's result,
naming the records it cut and those it left without a counted token.

The refusals are the app's answers: they run on the same app and settings in this process
(``tests.helpers.app``, the fast tier); what a job collects runs on the server.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from engram_fixtures.live import LiveServer, start_server, stop_server, wait_for_job
from engram_fixtures.models import make_tiny_llama
from service.datasets.spool import record_line
from service.engine.records import Record
from tests.helpers.api import assert_problem, unchanged
from tests.helpers.app import InProcessServer, in_process_server

MODEL = "shapes/tiny"
MAX_LENGTH = 32
MAX_BYTES = 256 * 1024
RECORDS = [
    {"text": "the cat sat on the mat"},
    {"text": "héllo wörld 😀 日本語"},
    {"prompt": "Q: who wrote it?", "completion": " Ada"},
]


def jsonl(records: list[dict[str, Any]], newline: str = "\n") -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + newline for r in records).encode()


def digest_of(records: list[dict[str, Any]]) -> str:
    return hashlib.sha256(b"".join(record_line(Record.from_mapping(r, i)) for i, r in enumerate(records))).hexdigest()


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dataset-shapes")
    make_tiny_llama(path / "models" / "tiny", hidden=32, layers=2, tie_word_embeddings=True)
    (path / "datasets").mkdir()
    return path


def settings(root: Path) -> dict[str, str]:
    """The module's settings, as a server's environment spells them."""
    return {
        "ENGRAM_DATASET_ROOTS": str(root / "datasets"),
        "ENGRAM_MAX_LENGTH": str(MAX_LENGTH),
        "ENGRAM_MAX_UPLOAD_BYTES": str(MAX_BYTES),
        "ENGRAM_MAX_DATASET_BYTES": str(MAX_BYTES),
    }


def register(api: httpx.Client, root: Path) -> None:
    response = api.post("/models", json={"model_id": MODEL, "source": f"file://{root / 'models' / 'tiny'}"})
    assert response.status_code == 201, response.text


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[LiveServer]:
    live = start_server(
        root / "store", root / "models", root / "server.log", ENGRAM_CACHE_DIR=str(root / "cache"), **settings(root)
    )
    try:
        register(live.client, root)
        yield live
    finally:
        stop_server(live)


@pytest.fixture(scope="module")
def app(root: Path) -> Iterator[InProcessServer]:
    """The same app and settings in this process (a store of its own): for what the app refuses."""
    with in_process_server(root / "in-process", root / "models", **settings(root)) as server:
        register(server.client, root)
        yield server


def upload(api: httpx.Client, name: str, data: bytes, filename: str = "data.jsonl") -> httpx.Response:
    return api.post("/concepts", data={"name": name, "models": MODEL}, files={"dataset": (filename, data)})


def reference(api: httpx.Client, name: str, path: Path, **options: Any) -> httpx.Response:
    return api.post("/concepts", json={"name": name, "models": [MODEL], "dataset": {"uri": f"file://{path}", **options}})


def collected(api: httpx.Client, response: httpx.Response) -> dict[str, Any]:
    """The succeeded collection job of a 202 answer with one job."""
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["jobs"][0]["job_id"])
    assert job["status"] == "succeeded", job
    return job


def failed(api: httpx.Client, response: httpx.Response) -> dict[str, Any]:
    """The problem of the failed collection job of a 202 answer (a reference the job refused)."""
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["jobs"][0]["job_id"])
    assert job["status"] == "failed", job
    return dict(job["error"])


def inline(api: httpx.Client, name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    return collected(api, api.post("/concepts", json={"name": name, "models": [MODEL], "records": records}))


# ---------------------------------------------------------------- shapes that are read


def gzip_members(data: bytes) -> bytes:
    """``data`` as two concatenated gzip members (what ``cat a.gz b.gz`` and bgzip write)."""
    half = len(data) // 2
    return gzip.compress(data[:half]) + gzip.compress(data[half:])


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(jsonl(RECORDS), id="plain"),
        pytest.param(b"\xef\xbb\xbf" + jsonl(RECORDS), id="bom"),
        pytest.param(jsonl(RECORDS, "\r\n"), id="crlf"),
        pytest.param(b"\n \t\n" + jsonl(RECORDS).replace(b"\n", b"  \n\n"), id="blank-lines-and-trailing-space"),
        pytest.param(gzip.compress(jsonl(RECORDS)), id="gzip"),
        pytest.param(gzip.compress(b"\xef\xbb\xbf" + jsonl(RECORDS, "\r\n")), id="gzip-bom-crlf"),
        pytest.param(gzip_members(jsonl(RECORDS)), id="gzip-two-members"),
    ],
)
def test_an_upload_in_a_promised_shape_is_the_records_posted_inline(server: LiveServer, data: bytes) -> None:
    api = server.client
    expected = inline(api, "shapes-inline", RECORDS)
    name = f"shapes-upload-{hashlib.sha256(data).hexdigest()[:12]}"
    job = collected(api, upload(api, name, data, "data.jsonl.gz" if data[:2] == b"\x1f\x8b" else "data.jsonl"))
    concept = api.get(f"/concepts/{name}").json()
    assert concept["num_records"] == len(RECORDS)
    assert concept["dataset_digest"] == digest_of(RECORDS)
    assert job["result"]["tokens"] == expected["result"]["tokens"]


@pytest.mark.parametrize(
    ("filename", "data"),
    [
        pytest.param("facts.jsonl.gz", gzip.compress(jsonl(RECORDS)), id="jsonl.gz"),
        pytest.param("facts.ndjson.gz", gzip_members(jsonl(RECORDS, "\r\n")), id="ndjson.gz-two-members"),
        pytest.param("facts.jsonl", b"\xef\xbb\xbf" + jsonl(RECORDS, "\r\n") + b"\n\n", id="bom-crlf-blank"),
    ],
)
def test_a_file_reference_in_a_promised_shape_is_the_records_posted_inline(
    server: LiveServer, root: Path, filename: str, data: bytes
) -> None:
    path = root / "datasets" / filename
    path.write_bytes(data)
    api = server.client
    name = f"shapes-ref-{filename.replace('.', '-')}"
    collected(api, reference(api, name, path))
    concept = api.get(f"/concepts/{name}").json()
    assert concept["dataset"]["format"] == "jsonl"
    assert (concept["num_records"], concept["dataset_digest"]) == (len(RECORDS), digest_of(RECORDS))


def test_parquet_of_several_row_groups_with_a_mapping_and_a_row_range(server: LiveServer, root: Path) -> None:
    questions = [f"Q{i}: what is {i}?" for i in range(10)]
    answers = [f" {i} 😀" for i in range(10)]
    path = root / "datasets" / "groups.parquet"
    pq.write_table(pa.table({"question": questions, "answer": answers, "id": list(range(10))}), path, row_group_size=3)
    api = server.client
    mapping = {"prompt": "question", "completion": "answer"}
    collected(api, reference(api, "shapes-groups", path, columns=mapping, rows={"start": 2, "stop": 8}))
    kept = [{"prompt": q, "completion": a} for q, a in zip(questions[2:8], answers[2:8], strict=True)]
    concept = api.get("/concepts/shapes-groups").json()
    assert (concept["num_records"], concept["dataset_digest"]) == (6, digest_of(kept))


# ---------------------------------------------------------------- shapes that are refused, clearly


@pytest.mark.parametrize(
    ("data", "status", "mentions"),
    [
        pytest.param(json.dumps(RECORDS, indent=2).encode(), 422, ("JSON array", "JSON Lines"), id="json-array"),
        pytest.param(json.dumps(RECORDS).encode(), 422, ("JSON array", "JSON Lines"), id="json-array-one-line"),
        pytest.param(gzip.compress(json.dumps(RECORDS).encode()), 422, ("JSON array",), id="gzip-json-array"),
        pytest.param(b"text\nthe cat sat\n", 400, ("line 1", "JSON Lines", "CSV"), id="csv"),
        pytest.param(b"prompt\tcompletion\nQ\tA\n", 400, ("line 1", "JSON Lines", "TSV"), id="tsv"),
        pytest.param(b"the cat sat on the mat\n", 400, ("line 1", "JSON Lines"), id="plain-text"),
        pytest.param(b"PAR1\x15\x04\x15\x10", 422, ("Parquet", "dataset reference"), id="parquet"),
        pytest.param(b"PK\x03\x04\x14\x00\x00\x00", 422, ("zip",), id="zip"),
        pytest.param(gzip.compress(jsonl(RECORDS))[:-12], 400, ("gzip", "ends"), id="gzip-cut-short"),
        pytest.param(b"\x1f\x8b\x08\x00garbage-not-deflate", 400, ("gzip",), id="gzip-corrupt"),
        pytest.param(gzip.compress(jsonl(RECORDS)) + b"trailing", 400, ("gzip",), id="gzip-trailing-bytes"),
        pytest.param(jsonl(RECORDS[:1]) + '{"text": "caf\xe9"}\n'.encode("latin-1"), 400, ("line 2", "UTF-8"), id="latin-1"),
        pytest.param(jsonl([*RECORDS, {"text": ""}]), 422, ("line 4", "'text'"), id="empty-text"),
        pytest.param(jsonl([{"text": "a", "id": 7}]), 422, ("line 1", "'id'"), id="unknown-field"),
        pytest.param(jsonl([{"text": {"en": "nested"}}]), 422, ("line 1", "'text'", "an object"), id="nested-field"),
        pytest.param(b"\n\r\n  \n", 422, ("no records",), id="no-records"),
    ],
)
@pytest.mark.fast
def test_an_upload_in_a_shape_not_read_is_a_clear_problem_that_changes_nothing(
    app: InProcessServer, data: bytes, status: int, mentions: tuple[str, ...]
) -> None:
    server = app
    with unchanged(server):
        assert_problem(upload(server.client, "shapes-refused", data), status, *mentions)
    assert server.client.get("/concepts/shapes-refused").status_code == 404


@pytest.mark.fast
def test_a_compressed_request_body_is_a_415_that_says_what_is_read(app: InProcessServer) -> None:
    server = app
    body = json.dumps({"name": "shapes-encoded", "models": [MODEL], "records": RECORDS}).encode()
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    with unchanged(server):
        response = server.client.post("/concepts", content=gzip.compress(body), headers=headers)
        assert_problem(response, 415, "Content-Encoding", "multipart")


@pytest.mark.fast
def test_a_gzip_bomb_is_stopped_at_the_upload_limit(app: InProcessServer) -> None:
    server = app
    line = jsonl([{"text": "a " * 1000}])
    bomb = gzip.compress(line * (4 * MAX_BYTES // len(line)), compresslevel=9)
    assert len(bomb) < MAX_BYTES // 8
    with unchanged(server):
        assert_problem(upload(server.client, "shapes-bomb", bomb), 413, "ENGRAM_MAX_UPLOAD_BYTES", "decompressed")


@pytest.mark.parametrize(
    ("filename", "data", "mentions"),
    [
        pytest.param("array.json", json.dumps(RECORDS).encode(), ("JSON array", "JSON Lines"), id="json-array"),
        pytest.param("array.json.gz", gzip.compress(json.dumps(RECORDS).encode()), ("JSON array",), id="json.gz-array"),
        pytest.param("rows.jsonl", b"question,answer\nQ,A\n", ("line 1", "JSON Lines"), id="csv-as-jsonl"),
    ],
)
def test_a_file_reference_in_a_shape_not_read_fails_its_job_clearly(
    server: LiveServer, root: Path, filename: str, data: bytes, mentions: tuple[str, ...]
) -> None:
    path = root / "datasets" / filename
    path.write_bytes(data)
    api = server.client
    name = f"shapes-bad-{filename.replace('.', '-')}"
    problem = failed(api, reference(api, name, path))
    for mention in mentions:
        assert mention in problem["detail"], problem
    assert api.get(f"/concepts/{name}").json()["dataset"]["error"] == problem["detail"]


def test_a_row_range_past_the_end_names_the_rows_there_are(server: LiveServer, root: Path) -> None:
    path = root / "datasets" / "three.jsonl"
    path.write_bytes(jsonl(RECORDS))
    api = server.client
    problem = failed(api, reference(api, "shapes-past-end", path, rows={"start": 100}))
    assert "100" in problem["detail"] and "3 rows" in problem["detail"], problem
    pq.write_table(pa.table({"text": ["a", "b"]}), root / "datasets" / "two.parquet")
    problem = failed(api, reference(api, "shapes-past-end-pq", root / "datasets" / "two.parquet", rows={"start": 5}))
    assert "5" in problem["detail"] and "2 rows" in problem["detail"], problem


# ---------------------------------------------------------------- truncation is stated


def test_truncation_at_max_length_is_stated_in_the_job_result(server: LiveServer, root: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(root / "models" / "tiny")
    long = " ".join(f"word{i}" for i in range(100))
    records = [
        {"text": long},  # cut at MAX_LENGTH
        {"prompt": long, "completion": " the answer"},  # its completion lies wholly beyond MAX_LENGTH
        {"text": "short and whole"},
    ]
    whole = len(tokenizer(long)["input_ids"])
    short = len(tokenizer("short and whole")["input_ids"])
    assert whole > MAX_LENGTH and short < MAX_LENGTH
    api = server.client
    job = collected(api, api.post("/concepts", json={"name": "shapes-long", "models": [MODEL], "records": records}))
    result = job["result"]
    assert result["tokens"] == MAX_LENGTH + short
    assert result["records"] == 3
    assert result["truncated"]["max_length"] == MAX_LENGTH
    assert result["truncated"]["records"] == 2 and result["truncated"]["first"] == [0, 1]
    cut_from_prompt = whole + len(tokenizer(" the answer", add_special_tokens=False)["input_ids"]) - MAX_LENGTH
    assert result["truncated"]["tokens"] == (whole - MAX_LENGTH) + cut_from_prompt
    assert result["uncounted"] == {"records": 1, "first": [1]}
    # The same records again under another name reuse the statistics and state the same.
    again = collected(api, api.post("/concepts", json={"name": "shapes-long-2", "models": [MODEL], "records": records}))
    assert again["result"]["reused"] is True
    assert {k: again["result"][k] for k in ("truncated", "uncounted", "records")} == {
        k: result[k] for k in ("truncated", "uncounted", "records")
    }


def test_a_dataset_whose_counted_tokens_all_lie_beyond_max_length_names_the_setting(server: LiveServer) -> None:
    long = " ".join(f"word{i}" for i in range(100))
    api = server.client
    response = api.post(
        "/concepts", json={"name": "shapes-all-cut", "models": [MODEL], "records": [{"prompt": long, "completion": " x"}]}
    )
    problem = failed(api, response)
    assert "ENGRAM_MAX_LENGTH" in problem["detail"] and str(MAX_LENGTH) in problem["detail"], problem


def test_many_tiny_records_are_all_counted(server: LiveServer) -> None:
    data = io.BytesIO()
    with gzip.GzipFile(fileobj=data, mode="wb") as file:
        for i in range(5000):
            file.write(jsonl([{"text": f"{i % 10}"}]))
    api = server.client
    job = collected(api, upload(api, "shapes-tiny", data.getvalue(), "tiny.jsonl.gz"))
    assert api.get("/concepts/shapes-tiny").json()["num_records"] == 5000
    assert job["result"]["tokens"] == 2 * 5000  # BOS and the digit
    assert job["result"]["truncated"]["records"] == 0 and job["result"]["uncounted"]["records"] == 0
