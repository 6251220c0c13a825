"""Datasets by reference name content, not only a place (issue 15): fingerprints and the hub cache.

The API fingerprints what a reference names when it is posted (``fingerprint_reference``: a stat, an
S3 HEAD, the hub commit) and the job (``resolve_reference``) reads exactly that content or fails
with a 409 that says to post the concept again. These tests run the worker's own functions on real
files and a real SeaweedFS (versioned and unversioned buckets). The Hugging Face hub cannot be
reached here: the hub's answer to "which commit is this revision" is mocked (the one boundary these
tests cannot run), and downloads are served from a real hub cache layout on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.config import Settings
from service.datasets.fingerprints import hub_commit
from service.datasets.hf_cache import trim_hf_cache
from service.datasets.refs import StoredReference, resolve_reference, submitted_reference
from service.datasets.spool import record_line
from service.engine.records import Record
from service.errors import Conflict, InvalidInput
from tests.helpers.s3 import SeaweedServer, drop_bucket, new_bucket

OLD = [{"text": f"old row {i}"} for i in range(30)]
NEW = [{"text": f"new row {i}"} for i in range(30)]
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def parquet(records: list[dict[str, Any]], path: Path, group_rows: int = 10) -> bytes:
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=group_rows)
    return path.read_bytes()


def big(tag: str) -> list[dict[str, Any]]:
    """15,000 rows of 200 characters that do not compress (3 MB): in row groups of 5,000 rows, more
    than a batch and the reader's 1 MiB buffer, the later groups are read by later ranged GETs."""
    return [{"text": f"{tag} {i} " + os.urandom(100).hex()} for i in range(15_000)]


def digest_of(records: list[dict[str, Any]]) -> str:
    return hashlib.sha256(b"".join(record_line(Record.from_mapping(r, i)) for i, r in enumerate(records))).hexdigest()


@pytest.fixture
def settings(tmp_path: Path, seaweed: SeaweedServer, request: pytest.FixtureRequest) -> Settings:
    (tmp_path / "data").mkdir()
    # s3:// datasets are read from listed buckets only (ENGRAM_DATASET_BUCKETS): the test's own.
    buckets = [request.getfixturevalue(name) for name in ("bucket", "versioned_bucket") if name in request.fixturenames]
    return Settings(
        dataset_roots=str(tmp_path / "data"),
        cache_dir=tmp_path / "cache",
        s3_endpoint_url=seaweed.endpoint_url,
        dataset_buckets=",".join(buckets),
    )


def resolve(reference: StoredReference | dict[str, Any], settings: Settings, tmp_path: Path, check: Any = None) -> Any:
    folder = tmp_path / f"spool-{time.monotonic_ns()}"
    folder.mkdir()
    return resolve_reference(StoredReference.model_validate(reference), settings, folder, check)


def post(uri: str, settings: Settings) -> StoredReference:
    """The reference as the API stores it on the concept (checked and fingerprinted)."""
    return submitted_reference({"uri": uri}, settings)


def assert_changed(exc: pytest.ExceptionInfo[Conflict], uri: str, when: str) -> None:
    assert exc.value.status == 409
    assert uri in exc.value.detail and f"changed {when}" in exc.value.detail, exc.value.detail
    assert "post the concept again" in exc.value.detail


# ---------------------------------------------------------------- file://


def test_a_file_fingerprint_follows_writes_and_replacements_not_reads(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "data" / "facts.jsonl"
    path.write_bytes(jsonl(OLD))
    uri = f"file://{path}"
    first = post(uri, settings).fingerprint
    assert set(first) == {"size", "mtime_ns", "inode"}
    resolve(post(uri, settings), settings, tmp_path)  # reading changes nothing
    assert post(uri, settings).fingerprint == first
    os.utime(path, ns=(first["mtime_ns"], first["mtime_ns"] + 1_000_000))  # touched: other content, maybe
    touched = post(uri, settings).fingerprint
    assert touched != first and touched["size"] == first["size"]
    # Replaced by a rename with the same size and mtime (an atomic publish): the inode tells.
    replacement = tmp_path / "data" / "next.jsonl"
    replacement.write_bytes(jsonl(NEW))
    os.utime(replacement, ns=(touched["mtime_ns"], touched["mtime_ns"]))
    os.replace(replacement, path)
    replaced = post(uri, settings).fingerprint
    assert replaced["inode"] != touched["inode"] and replaced["size"] == touched["size"]


def test_a_missing_file_has_no_fingerprint_and_its_job_says_it_is_missing(settings: Settings, tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'data' / 'later.jsonl'}"
    reference = post(uri, settings)
    assert reference.fingerprint is None
    with pytest.raises(InvalidInput, match="does not exist"):
        resolve(reference, settings, tmp_path)


def test_a_file_changed_after_it_was_posted_fails_the_job(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "data" / "facts.jsonl"
    path.write_bytes(jsonl(OLD))
    reference = post(f"file://{path}", settings)
    path.write_bytes(jsonl(NEW))  # between the POST and the job
    with pytest.raises(Conflict) as exc:
        resolve(reference, settings, tmp_path)
    assert_changed(exc, f"file://{path}", "after the concept was posted")
    # Posted again, the new content is read.
    assert resolve(post(f"file://{path}", settings), settings, tmp_path).digest == digest_of(NEW)


def test_a_file_written_while_it_is_read_fails_the_job(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "data" / "facts.jsonl"
    path.write_bytes(jsonl(OLD))
    reference = post(f"file://{path}", settings)

    def append_once() -> None:  # the job's cancellation check runs at the first row: write then
        if path.stat().st_size == len(jsonl(OLD)):
            with path.open("ab") as handle:
                handle.write(jsonl(NEW[:1]))

    with pytest.raises(Conflict) as exc:
        resolve(reference, settings, tmp_path, check=append_once)
    assert_changed(exc, f"file://{path}", "while it was being read")


# ---------------------------------------------------------------- s3://


@pytest.fixture
def bucket(s3_env: SeaweedServer) -> Iterator[str]:
    name = new_bucket(s3_env, "fingerprint")
    try:
        yield name
    finally:
        drop_bucket(s3_env, name)


@pytest.fixture
def versioned_bucket(s3_env: SeaweedServer) -> Iterator[str]:
    client = s3_env.client()
    name = new_bucket(s3_env, "versioned")
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    try:
        yield name
    finally:
        for page in client.get_paginator("list_object_versions").paginate(Bucket=name):
            for item in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
                client.delete_object(Bucket=name, Key=item["Key"], VersionId=item["VersionId"])
        client.delete_bucket(Bucket=name)


def test_an_s3_fingerprint_is_the_etag_and_size(settings: Settings, s3_env: SeaweedServer, bucket: str) -> None:
    client = s3_env.client()
    client.put_object(Bucket=bucket, Key="facts.jsonl", Body=jsonl(OLD))
    uri = f"s3://{bucket}/facts.jsonl"
    first = post(uri, settings).fingerprint
    head = client.head_object(Bucket=bucket, Key="facts.jsonl")
    assert first == {"etag": head["ETag"], "size": len(jsonl(OLD))}  # unversioned: no version to pin
    assert post(uri, settings).fingerprint == first
    client.put_object(Bucket=bucket, Key="facts.jsonl", Body=jsonl(NEW))
    assert post(uri, settings).fingerprint["etag"] != first["etag"]
    assert post(f"s3://{bucket}/missing.jsonl", settings).fingerprint is None


def test_a_deployment_without_s3_credentials_takes_no_fingerprint_and_its_job_says_why(
    settings: Settings, s3_env: SeaweedServer, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No AWS credentials anywhere: the POST is not a server error (the API's own storage may be
    elsewhere); the reference is stored without a fingerprint and its job fails naming the cause."""
    s3_env.client().put_object(Bucket=bucket, Key="facts.jsonl", Body=jsonl(OLD))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    reference = post(f"s3://{bucket}/facts.jsonl", settings)
    assert reference.fingerprint is None
    with pytest.raises(Exception, match="AWS_ACCESS_KEY_ID"):
        resolve_reference(reference, settings, tmp_path / "out")


def test_an_s3_object_replaced_after_it_was_posted_fails_the_job(
    settings: Settings, s3_env: SeaweedServer, bucket: str, tmp_path: Path
) -> None:
    client = s3_env.client()
    client.put_object(Bucket=bucket, Key="facts.jsonl", Body=jsonl(OLD))
    uri = f"s3://{bucket}/facts.jsonl"
    reference = post(uri, settings)
    client.put_object(Bucket=bucket, Key="facts.jsonl", Body=jsonl(NEW))
    with pytest.raises(Conflict) as exc:
        resolve(reference, settings, tmp_path)
    assert_changed(exc, uri, "after the concept was posted")
    assert reference.fingerprint["etag"] in exc.value.detail
    assert resolve(post(uri, settings), settings, tmp_path).digest == digest_of(NEW)


def test_an_s3_object_replaced_while_it_is_read_fails_the_job(
    settings: Settings, s3_env: SeaweedServer, bucket: str, tmp_path: Path
) -> None:
    client = s3_env.client()
    client.put_object(Bucket=bucket, Key="facts.parquet", Body=parquet(big("old"), tmp_path / "old.parquet", 5000))
    replacement = parquet(big("new"), tmp_path / "new.parquet", 5000)
    uri = f"s3://{bucket}/facts.parquet"
    reference = post(uri, settings)
    replaced = []

    def replace_once() -> None:  # at the first row: the later row groups are still to be read
        if not replaced:
            client.put_object(Bucket=bucket, Key="facts.parquet", Body=replacement)
            replaced.append(True)

    with pytest.raises(Conflict) as exc:
        resolve(reference, settings, tmp_path, check=replace_once)
    assert_changed(exc, uri, "while it was being read")


def test_a_versioned_s3_object_is_read_at_the_version_posted(
    settings: Settings, s3_env: SeaweedServer, versioned_bucket: str, tmp_path: Path
) -> None:
    client = s3_env.client()
    put = client.put_object(Bucket=versioned_bucket, Key="facts.jsonl", Body=jsonl(OLD))
    uri = f"s3://{versioned_bucket}/facts.jsonl"
    reference = post(uri, settings)
    assert reference.fingerprint["version_id"] == put["VersionId"]
    client.put_object(Bucket=versioned_bucket, Key="facts.jsonl", Body=jsonl(NEW))
    # The posted version still exists: the job reads it, not what the key holds now.
    assert resolve(reference, settings, tmp_path).digest == digest_of(OLD)
    newer = post(uri, settings)
    assert newer.fingerprint["version_id"] != put["VersionId"]
    assert resolve(newer, settings, tmp_path).digest == digest_of(NEW)
    client.delete_object(Bucket=versioned_bucket, Key="facts.jsonl", VersionId=put["VersionId"])
    with pytest.raises(InvalidInput, match=f"no version {put['VersionId']}"):
        resolve(reference, settings, tmp_path)


# ---------------------------------------------------------------- hf://


def hub_repo(cache: Path, repo: str, commits: dict[str, bytes], main: str | None = None) -> Path:
    """A hub cache as huggingface_hub lays it out: blobs, snapshot links to them, refs/main."""
    folder = cache / f"datasets--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, data in commits.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / "data" / "facts.jsonl"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if main is not None:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(main)
    return folder


class FakeInfo:
    def __init__(self, sha: str) -> None:
        self.sha = sha


def test_a_commit_revision_is_its_own_fingerprint_without_asking_the_hub(tmp_path: Path) -> None:
    # The hub is mocked: it cannot be reached from here, and a commit must not need it.
    with mock.patch("huggingface_hub.HfApi.dataset_info", side_effect=AssertionError("no hub call")) as hub:
        assert hub_commit("org/facts", COMMIT_A, tmp_path) == COMMIT_A
    hub.assert_not_called()


def test_a_branch_resolves_to_the_hubs_commit_else_the_cached_ref(tmp_path: Path) -> None:
    # The hub is mocked (unreachable here): first it answers, then it fails as it does offline.
    hub_repo(tmp_path, "org/facts", {COMMIT_A: b"x"}, main=COMMIT_A)
    with mock.patch("huggingface_hub.HfApi.dataset_info", return_value=FakeInfo(COMMIT_B)) as hub:
        assert hub_commit("org/facts", None, tmp_path) == COMMIT_B
        assert hub_commit("org/facts", "v2", tmp_path) == COMMIT_B
    assert [c.kwargs["revision"] for c in hub.call_args_list] == [None, "v2"]
    from huggingface_hub.errors import OfflineModeIsEnabled

    with mock.patch("huggingface_hub.HfApi.dataset_info", side_effect=OfflineModeIsEnabled("offline")):
        assert hub_commit("org/facts", None, tmp_path) == COMMIT_A  # what an offline download reads
        assert hub_commit("org/facts", "v2", tmp_path) is None  # no ref cached for it
        assert hub_commit("org/other", None, tmp_path) is None


def test_an_hf_reference_is_read_at_the_commit_posted(settings: Settings, tmp_path: Path) -> None:
    cache = settings.cache_dir / "hf-datasets"
    hub_repo(cache, "org/facts", {COMMIT_A: jsonl(OLD)}, main=COMMIT_A)
    uri = "hf://datasets/org/facts/data/facts.jsonl"
    with mock.patch("huggingface_hub.HfApi.dataset_info", side_effect=OSError("no network here")):
        reference = post(uri, settings)
    assert reference.fingerprint == {"commit": COMMIT_A}
    hub_repo(cache, "org/facts", {COMMIT_B: jsonl(NEW)}, main=COMMIT_B)  # main moved on since
    assert resolve(reference, settings, tmp_path).digest == digest_of(OLD)
    with mock.patch("huggingface_hub.HfApi.dataset_info", return_value=FakeInfo(COMMIT_B)):
        newer = post(uri, settings)
    assert newer.fingerprint == {"commit": COMMIT_B}
    assert resolve(newer, settings, tmp_path).digest == digest_of(NEW)


# ---------------------------------------------------------------- the hub download cache


def aged(path: Path, seconds_ago: float) -> Path:
    when = time.time() - seconds_ago
    os.utime(path, (when, when))
    return path


def test_trimming_keeps_the_newest_files_under_the_budget(tmp_path: Path) -> None:
    cache = tmp_path / "hf-datasets"
    folder = hub_repo(cache, "org/facts", {c * 40: bytes([65 + i]) * 1000 for i, c in enumerate("abcdef")})
    blobs = sorted(folder.glob("blobs/*"), key=lambda p: p.read_bytes()[:1])  # a..f
    for age, blob in zip(range(60, 0, -10), blobs, strict=True):  # a is the least recently used
        aged(blob, age)
    partial = folder / "blobs" / "0123.incomplete"  # another process's download in progress
    partial.write_bytes(b"p" * 5000)
    aged(partial, 3600)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("f" * 40)
    in_use = blobs[0]  # the least recently used, but the current job reads it

    removed = trim_hf_cache(cache, 3500, keep={in_use})

    assert removed == blobs[1:4]  # b, c, d: the least recently used, oldest first
    left = [b for b in blobs if b.exists()]
    assert left == [in_use, blobs[4], blobs[5]]
    assert sum(p.stat().st_size for p in left) == 3000  # within the budget of 3500 (each file 1000 bytes)
    assert partial.exists() and (folder / "refs" / "main").exists()
    links = sorted(p for p in (folder / "snapshots").rglob("facts.jsonl"))
    assert len(links) == 3 and all(link.exists() for link in links)  # dangling links went with their blobs


def test_a_file_in_use_stays_even_over_the_budget(tmp_path: Path) -> None:
    cache = tmp_path / "hf-datasets"
    folder = hub_repo(cache, "org/facts", {COMMIT_A: b"a" * 1000, COMMIT_B: b"b" * 1000})
    old, new = sorted(folder.glob("blobs/*"), key=lambda p: p.read_bytes()[:1])
    aged(old, 10)
    link = folder / "snapshots" / COMMIT_A / "data" / "facts.jsonl"
    assert trim_hf_cache(cache, 0, keep={link}) == [new]  # keep given as the snapshot link: resolved
    assert old.exists() and not new.exists()


def test_each_hf_fetch_trims_the_cache_to_its_budget(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache", hf_datasets_cache_bytes=len(jsonl(OLD)) + 100)
    cache = settings.cache_dir / "hf-datasets"
    hub_repo(cache, "org/facts", {COMMIT_A: jsonl(OLD)})
    hub_repo(cache, "org/more", {COMMIT_B: jsonl(NEW)})
    for blob in cache.glob("*/blobs/*"):
        aged(blob, 3600)  # both downloaded an hour ago; org/more's is read now
    old_blob = next(cache.glob("datasets--org--facts/blobs/*"))
    reference = {"uri": f"hf://datasets/org/more@{COMMIT_B}/data/facts.jsonl", "format": "jsonl"}
    assert resolve(reference, settings, tmp_path).digest == digest_of(NEW)
    assert not old_blob.exists()  # the least recently used went to make room
    kept = next(cache.glob("datasets--org--more/blobs/*"))
    assert time.time() - kept.stat().st_mtime < 60  # its use counts: it is the most recently used now
    total = sum(p.stat().st_size for p in cache.glob("*/blobs/*"))
    assert total <= settings.hf_datasets_cache_bytes
