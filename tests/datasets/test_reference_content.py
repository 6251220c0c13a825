"""A concept posted by dataset reference follows the content, not only the URI (issue 15).

Through a real server (embedded mode, file storage) reading ``file://`` datasets from its dataset
root and ``s3://`` datasets from a real SeaweedFS:

- the same request over unchanged content is the same concept: the same collection job, digest and
  statistics, nothing started;
- the same request after the file or object changed is a new concept over the new content: a new
  collection whose statistics are those of the new records (the old answer was the stale concept);
- content that did not change although its fingerprint did (a touched file) gets a new job that
  finds the statistics of its digest already there: nothing is collected again.

A change between the POST and the job's read is tested on the job's own function with real files
and S3 in ``tests/concepts/test_dataset_fingerprints.py`` (here the job would run before a test could
change the file).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.live import LiveServer, running_server, wait_for_job
from engram_fixtures.models import make_tiny_chat_llama
from service.datasets.spool import record_line
from service.engine.records import Record
from tests.helpers.s3 import SeaweedServer

MODEL = "tiny/ref"
FIRST = [{"text": f"The first version of fact {i} says blue."} for i in range(12)]
SECOND = [{"text": f"Fact {i}, second edition: the answer is now a much longer green sentence."} for i in range(20)]


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def digest_of(records: list[dict[str, Any]]) -> str:
    return hashlib.sha256(b"".join(record_line(Record.from_mapping(r, i)) for i, r in enumerate(records))).hexdigest()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reference-content")
    make_tiny_chat_llama(path / "models" / "tiny")
    (path / "datasets").mkdir()
    return path


@pytest.fixture(scope="module")
def server(root: Path, seaweed: SeaweedServer, s3_bucket: str) -> Iterator[LiveServer]:
    with running_server(
        root,
        root / "models",
        ENGRAM_DATASET_ROOTS=str(root / "datasets"),
        ENGRAM_DATASET_BUCKETS=s3_bucket,
        ENGRAM_S3_ENDPOINT_URL=seaweed.endpoint_url,
        ENGRAM_CACHE_DIR=str(root / "cache"),
        **seaweed.env(),
    ) as live:
        response = live.client.post("/models", json={"model_id": MODEL, "source": f"file://{root / 'models' / 'tiny'}"})
        assert response.status_code == 201, response.text
        yield live


def post(api: httpx.Client, name: str, uri: str, **body: Any) -> httpx.Response:
    return api.post("/concepts", json={"name": name, "models": [MODEL], "dataset": {"uri": uri}, **body})


def collected(api: httpx.Client, response: httpx.Response) -> dict[str, Any]:
    """The succeeded collection job of a 202 answer."""
    assert response.status_code == 202, response.text
    (job,) = response.json()["jobs"]
    job = wait_for_job(api, job["job_id"])
    assert job["status"] == "succeeded", job
    return job


def concept(api: httpx.Client, name: str) -> dict[str, Any]:
    response = api.get(f"/concepts/{name}")
    assert response.status_code == 200, response.text
    return response.json()


def tokens_of(server: LiveServer, job: dict[str, Any]) -> int:
    manifest = json.loads((server.storage_dir / job["result"]["stats"] / "manifest.json").read_text())
    return int(manifest["tokens"])


def test_a_changed_file_is_a_new_concept_and_an_unchanged_one_the_same(server: LiveServer, root: Path) -> None:
    api, path = server.client, root / "datasets" / "facts.jsonl"
    path.write_bytes(jsonl(FIRST))
    uri = f"file://{path}"
    first = collected(api, post(api, "facts", uri, role="reference", description="facts, as the file says"))
    assert concept(api, "facts")["dataset_digest"] == digest_of(FIRST)

    again = post(api, "facts", uri)  # the same request, the same content: the same concept
    assert again.status_code == 202, again.text
    assert [j["job_id"] for j in again.json()["jobs"]] == [first["job_id"]]
    assert again.json()["concept"]["dataset_digest"] == digest_of(FIRST)

    path.write_bytes(jsonl(SECOND))
    changed = post(api, "facts", uri)
    assert changed.status_code == 202, changed.text
    pending = changed.json()["concept"]
    assert pending["dataset"]["status"] == "pending" and pending["dataset_digest"] is None, pending
    second = collected(api, changed)
    assert second["job_id"] != first["job_id"]
    assert second["result"]["reused"] is False  # collected over the new records
    assert second["result"]["stats"] != first["result"]["stats"]
    assert tokens_of(server, second) > tokens_of(server, first)  # more and longer records
    now = concept(api, "facts")
    assert now["dataset_digest"] == digest_of(SECOND) and now["num_records"] == len(SECOND), now
    state = {k: v for k, v in now["models"][MODEL].items() if k != "truncation"}
    assert state == {"status": "ready", "tokens": tokens_of(server, second), "job_id": second["job_id"]}
    # The new concept keeps what the request left out: role and description.
    assert now["role"] == "reference" and now["description"] == "facts, as the file says"

    third = post(api, "facts", uri)  # unchanged since: idempotent again
    assert [j["job_id"] for j in third.json()["jobs"]] == [second["job_id"]]


def test_a_touched_file_is_collected_from_its_digest_not_again(server: LiveServer, root: Path) -> None:
    api, path = server.client, root / "datasets" / "touched.jsonl"
    path.write_bytes(jsonl(FIRST))
    uri = f"file://{path}"
    first = collected(api, post(api, "touched", uri))
    mtime = path.stat().st_mtime_ns
    os.utime(path, ns=(mtime + 5_000_000_000, mtime + 5_000_000_000))  # same bytes, other mtime
    second = collected(api, post(api, "touched", uri))
    assert second["job_id"] != first["job_id"]  # the fingerprint alone cannot tell the content is the same
    assert second["result"]["reused"] is True and second["result"]["stats"] == first["result"]["stats"]
    assert concept(api, "touched")["dataset_digest"] == digest_of(FIRST)


def test_a_replaced_s3_object_is_a_new_concept(server: LiveServer, seaweed: SeaweedServer, s3_bucket: str) -> None:
    api, client = server.client, seaweed.client()
    client.put_object(Bucket=s3_bucket, Key="sets/facts.jsonl", Body=jsonl(FIRST))
    uri = f"s3://{s3_bucket}/sets/facts.jsonl"
    first = collected(api, post(api, "s3-facts", uri))
    assert [j["job_id"] for j in post(api, "s3-facts", uri).json()["jobs"]] == [first["job_id"]]
    client.put_object(Bucket=s3_bucket, Key="sets/facts.jsonl", Body=jsonl(SECOND))
    second = collected(api, post(api, "s3-facts", uri))
    assert second["job_id"] != first["job_id"] and second["result"]["stats"] != first["result"]["stats"]
    assert concept(api, "s3-facts")["dataset_digest"] == digest_of(SECOND)
    assert [j["job_id"] for j in post(api, "s3-facts", uri).json()["jobs"]] == [second["job_id"]]


def test_another_reference_under_the_same_name_is_still_a_conflict(server: LiveServer, root: Path) -> None:
    api, path = server.client, root / "datasets" / "rows.jsonl"
    path.write_bytes(jsonl(FIRST))
    collected(api, post(api, "rows", f"file://{path}"))
    path.write_bytes(jsonl(SECOND))  # changed content does not make another reading of it acceptable
    response = api.post(
        "/concepts", json={"name": "rows", "models": [MODEL], "dataset": {"uri": f"file://{path}", "rows": {"stop": 3}}}
    )
    assert response.status_code == 409, response.text
    assert "rows" in response.json()["detail"]
    role = post(api, "rows", f"file://{path}", role="reference")  # nor another role
    assert role.status_code == 409, role.text
    assert concept(api, "rows")["dataset_digest"] == digest_of(FIRST)  # and nothing was replaced
