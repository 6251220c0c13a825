"""Hostile requests of issue 23 (finding 9) against a real server: each is a 4xx problem, never a 500.

A header that is not UTF-8, a JSON integer longer than Python reads, ``s3://`` references to buckets
that are no bucket names, not listed in ``ENGRAM_DATASET_BUCKETS`` or the service's own store, and
``file://`` references to a FIFO or a socket (which could block the job that opens them). The
server stores on a real S3 server (SeaweedFS), so its own bucket exists to be refused.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from engram_fixtures.live import LiveServer, start_server, stop_server
from service.config import Settings
from service.datasets.refs import StoredReference, resolve_reference
from service.errors import InvalidInput
from tests.helpers.api import assert_problem
from tests.helpers.s3 import SeaweedServer, drop_bucket, new_bucket

NOT_UTF8 = b"caf\xe9"  # latin-1 "café": a valid HTTP field value, not UTF-8 text
HUGE = "1" * 5000  # over Python's 4,300-digit limit for reading an integer


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hardening")
    (path / "datasets").mkdir()
    (path / "models").mkdir()
    (path / "datasets" / "facts.jsonl").write_text('{"text": "a fact"}\n')
    return path


@pytest.fixture(scope="module")
def store_bucket(seaweed: SeaweedServer) -> Iterator[str]:
    bucket = new_bucket(seaweed, "store")
    try:
        yield bucket
    finally:
        drop_bucket(seaweed, bucket)


@pytest.fixture(scope="module")
def unlisted_bucket(seaweed: SeaweedServer) -> Iterator[str]:
    bucket = new_bucket(seaweed, "unlisted")
    try:
        yield bucket
    finally:
        drop_bucket(seaweed, bucket)


@pytest.fixture(scope="module")
def server(
    root: Path, seaweed: SeaweedServer, s3_bucket: str, store_bucket: str, unlisted_bucket: str
) -> Iterator[LiveServer]:
    client = seaweed.client()
    for bucket in (s3_bucket, store_bucket, unlisted_bucket):  # a real object in each: only the rules refuse
        client.put_object(Bucket=bucket, Key="sets/facts.jsonl", Body=b'{"text": "a fact"}\n')
    live = start_server(
        root / "store",
        root / "models",
        root / "server.log",
        ENGRAM_STORAGE_URL=f"s3://{store_bucket}/engram",
        ENGRAM_S3_ENDPOINT_URL=seaweed.endpoint_url,
        ENGRAM_DATASET_ROOTS=str(root / "datasets"),
        ENGRAM_DATASET_BUCKETS=s3_bucket,
        ENGRAM_CACHE_DIR=str(root / "cache"),
        **seaweed.env(),
    )
    try:
        yield live
    finally:
        stop_server(live)


def _reference(server: LiveServer, uri: str) -> Any:
    """A concept by reference on a model that does not exist: the reference is checked first."""
    body = {"name": "hardening", "models": ["no/such-model"], "dataset": {"uri": uri}}
    return server.client.post("/concepts", json=body)


def _assert_no_traceback(server: LiveServer) -> None:
    assert "Traceback" not in server.log_tail(500_000), server.log_tail()


# ---------------------------------------------------------------- headers that are not UTF-8


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/models", "/concepts"])
def test_a_header_that_is_not_utf8_is_400_naming_it(server: LiveServer, path: str) -> None:
    response = server.client.get(path, headers={"x-client-note": NOT_UTF8})
    assert_problem(response, 400, "x-client-note", "UTF-8")
    assert response.headers["x-request-id"]  # still traceable
    again = server.client.post(path, headers={"user-agent": NOT_UTF8}, json={})
    assert_problem(again, 400, "user-agent")
    assert server.client.get("/healthz").status_code == 200
    _assert_no_traceback(server)


# ---------------------------------------------------------------- integers Python does not read


def test_a_json_integer_over_4300_digits_is_400_on_post_concepts(server: LiveServer) -> None:
    body = '{"name": "huge", "models": ["no/such-model"], "records": [{"text": "a"}], "description": ' + HUGE + "}"
    response = server.client.post("/concepts", content=body, headers={"content-type": "application/json"})
    assert_problem(response, 400, "4300 digits")
    assert_problem(server.client.get("/concepts/huge"), 404)
    _assert_no_traceback(server)


def test_a_jsonl_upload_line_with_an_integer_over_4300_digits_is_400_naming_the_line(server: LiveServer) -> None:
    dataset = b'{"text": "fine"}\n{"text": "x", "n": ' + HUGE.encode() + b"}\n"
    response = server.client.post(
        "/concepts",
        data={"name": "huge-upload", "models": "no/such-model"},
        files={"dataset": ("facts.jsonl", dataset, "application/jsonl")},
    )
    assert_problem(response, 400, "dataset line 2", "4300 digits")
    assert_problem(server.client.get("/concepts/huge-upload"), 404)
    _assert_no_traceback(server)


# ---------------------------------------------------------------- s3:// buckets


@pytest.mark.parametrize("bucket", ["bad_bucket!", "UPPER-case", "ab", "user@host", "host:9000", "b" * 64])
def test_an_s3_bucket_that_is_no_bucket_name_is_422_naming_the_rule(server: LiveServer, bucket: str) -> None:
    assert_problem(_reference(server, f"s3://{bucket}/sets/facts.jsonl"), 422, "not an S3 bucket name", "3 to 63")
    _assert_no_traceback(server)


def test_an_s3_bucket_outside_the_allowlist_is_422_naming_the_setting(server: LiveServer, unlisted_bucket: str) -> None:
    response = _reference(server, f"s3://{unlisted_bucket}/sets/facts.jsonl")
    assert_problem(response, 422, unlisted_bucket, "ENGRAM_DATASET_BUCKETS")


def test_the_services_own_bucket_is_never_a_dataset(server: LiveServer, store_bucket: str) -> None:
    response = _reference(server, f"s3://{store_bucket}/engram/concepts/x.jsonl")
    assert_problem(response, 422, "own store")


def test_a_listed_bucket_passes_the_reference_check(server: LiveServer, s3_bucket: str) -> None:
    # Past the reference check, the unknown model is what is refused.
    assert_problem(_reference(server, f"s3://{s3_bucket}/sets/facts.jsonl"), 404, "no/such-model")


def test_listing_the_stores_own_bucket_stops_the_service() -> None:
    with pytest.raises(ValidationError, match="own store|ENGRAM_STORAGE_URL"):
        Settings(storage_url="s3://engram-store/prefix", dataset_buckets="datasets-a, engram-store")
    with pytest.raises(ValidationError, match="not a bucket name"):
        Settings(dataset_buckets="datasets-a,Bad_Name")
    assert Settings(dataset_buckets=" datasets-a , datasets-b ").dataset_bucket_names == {"datasets-a", "datasets-b"}


def test_without_an_allowlist_s3_datasets_are_refused(tmp_path: Path) -> None:
    settings = Settings(dataset_roots=str(tmp_path))
    with pytest.raises(InvalidInput, match="ENGRAM_DATASET_BUCKETS: none"):
        resolve_reference(StoredReference(uri="s3://datasets-a/facts.jsonl", format="jsonl"), settings, tmp_path / "out")


# ---------------------------------------------------------------- files that are not regular files


def _make_special(kind: str, path: Path) -> socket.socket | None:
    if kind == "fifo":
        os.mkfifo(path)
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


@pytest.mark.parametrize(("kind", "named"), [("fifo", "FIFO"), ("socket", "socket")])
def test_a_dataset_that_is_no_regular_file_is_422_at_submission(
    server: LiveServer, root: Path, kind: str, named: str
) -> None:
    path = root / "datasets" / f"special-{kind}.jsonl"
    held = _make_special(kind, path)
    try:
        response = _reference(server, f"file://{path}")
        assert_problem(response, 422, str(path), named, "regular file")
    finally:
        path.unlink()
        if held is not None:
            held.close()


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_the_job_refuses_a_dataset_that_became_no_regular_file_without_blocking(tmp_path: Path, kind: str) -> None:
    """The job's own check, on a path that was a regular file when the concept was posted: it must
    answer at once (opening a FIFO for reading blocks until a writer comes, past any cancel)."""
    path = tmp_path / "facts.jsonl"
    held = _make_special(kind, path)
    settings = Settings(dataset_roots=str(tmp_path))
    reference = StoredReference(uri=f"file://{path}", format="jsonl", fingerprint={"size": 1, "mtime_ns": 1, "inode": 1})
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            resolve_reference(reference, settings, tmp_path / "out")
        except BaseException as exc:  # reported to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=10)
    try:
        if worker.is_alive():  # unblock the reader so the thread ends, then fail
            if kind == "fifo":
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail("the job blocked opening a non-regular dataset file")
        assert len(outcome) == 1 and isinstance(outcome[0], InvalidInput), outcome
        assert "regular file" in outcome[0].detail and str(path) in outcome[0].detail
    finally:
        if held is not None:
            held.close()


def test_the_job_opens_without_blocking_even_when_the_look_before_was_raced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO swapped in between the job's ``stat`` and its ``open``: stood in for by skipping the
    ``stat`` check (the swap itself cannot be timed from a test). The open must not block."""
    import service.datasets.sources as sources

    path = tmp_path / "facts.jsonl"
    os.mkfifo(path)
    monkeypatch.setattr(sources, "check_regular_file", lambda _: None)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            sources.open_source(f"file://{path}", Settings(dataset_roots=str(tmp_path))).close()
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("opening a FIFO blocked the job")
    assert len(outcome) == 1 and isinstance(outcome[0], InvalidInput) and "FIFO" in outcome[0].detail, outcome


def test_a_regular_dataset_file_still_reads(tmp_path: Path) -> None:
    (tmp_path / "facts.jsonl").write_text(json.dumps({"text": "a fact"}) + "\n")
    settings = Settings(dataset_roots=str(tmp_path))
    reference = StoredReference(uri=f"file://{tmp_path / 'facts.jsonl'}", format="jsonl")
    spooled = resolve_reference(reference, settings, tmp_path)
    assert spooled.num_records == 1
