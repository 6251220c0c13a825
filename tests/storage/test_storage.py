"""One contract for every storage backend: the same tests against LocalStorage and S3Storage.

The S3 backend runs against a real SeaweedFS (signatures checked), in a bucket of this module's
own, each test under a fresh prefix. Tests that only make sense for S3 (multipart, presigned URLs,
error translation) follow the shared contract.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.live import free_port
from service.storage.base import ObjectNotFound, Storage, StorageUnavailable
from service.storage.factory import open_storage
from service.storage.s3 import BucketNotFound, S3Storage, make_s3_client
from tests.helpers.s3 import PART, MiB, SeaweedServer, restart_seaweed, s3_storage, stop_seaweed

# ---------------------------------------------------------------- the shared contract


def test_bytes_round_trip_and_overwrite(storage: Storage) -> None:
    storage.put_bytes("a/b.bin", b"first")
    assert storage.get_bytes("a/b.bin") == b"first"
    storage.put_bytes("a/b.bin", b"second, longer")
    assert storage.get_bytes("a/b.bin") == b"second, longer"
    storage.put_bytes("empty", b"")
    assert storage.get_bytes("empty") == b""
    assert storage.size("empty") == 0


def test_json_round_trip(storage: Storage) -> None:
    storage.put_json("m/x.json", {"b": [1, 2], "a": "é"})
    assert storage.get_json("m/x.json") == {"a": "é", "b": [1, 2]}


def test_file_round_trip(storage: Storage, scratch: Path) -> None:
    data = os.urandom(300_000)
    (scratch / "in.bin").write_bytes(data)
    storage.put_file("files/deep/in.bin", scratch / "in.bin")
    storage.download("files/deep/in.bin", scratch / "out.bin")
    assert (scratch / "out.bin").read_bytes() == data
    assert storage.size("files/deep/in.bin") == len(data)


def test_exists_and_size(storage: Storage) -> None:
    assert not storage.exists("x/y")
    storage.put_bytes("x/y", b"12345")
    assert storage.exists("x/y")
    assert storage.size("x/y") == 5
    assert not storage.exists("x")  # a "directory" is not an object


def test_missing_objects_raise_object_not_found(storage: Storage, scratch: Path) -> None:
    with pytest.raises(ObjectNotFound):
        storage.get_bytes("no/such")
    with pytest.raises(ObjectNotFound):
        storage.size("no/such")
    with pytest.raises(ObjectNotFound):
        storage.download("no/such", scratch / "out")
    assert not (scratch / "out").exists()


def test_iter_range_of_missing_object_raises_object_not_found(storage: Storage) -> None:
    with pytest.raises(ObjectNotFound):
        list(storage.iter_range("no/such", 0, 10))


def test_find_json(storage: Storage) -> None:
    storage.put_json("j/ok.json", [1])
    storage.put_bytes("j/bad.json", b"{not json")
    assert storage.find_json("j/ok.json") == [1]
    assert storage.find_json("j/missing.json") is None
    assert storage.find_json("j/bad.json") is None
    assert storage.find_json("../escape.json") is None  # an invalid key names nothing


def test_list_by_prefix(storage: Storage) -> None:
    keys = ["a/1", "a/2/x", "a/20", "ab/3", "b/4", "a/2/y"]
    for key in keys:
        storage.put_bytes(key, key.encode())
    assert storage.list("") == sorted(keys)
    assert storage.list("a/") == ["a/1", "a/2/x", "a/2/y", "a/20"]
    assert storage.list("a/2") == ["a/2/x", "a/2/y", "a/20"]  # a prefix, not a directory
    assert storage.list("a") == ["a/1", "a/2/x", "a/2/y", "a/20", "ab/3"]
    assert storage.list("c/") == []


def test_list_many_keys_in_pages(storage: Storage) -> None:
    keys = sorted(f"many/{i:03d}.json" for i in range(30))
    for key in keys:
        storage.put_bytes(key, b"{}")
    assert storage.list("many/") == keys


def test_delete(storage: Storage) -> None:
    storage.put_bytes("d/1", b"1")
    storage.delete("d/1")
    assert not storage.exists("d/1")
    with pytest.raises(ObjectNotFound):
        storage.get_bytes("d/1")
    storage.delete("d/1")  # missing is fine
    storage.delete("never/was")


def test_delete_prefix(storage: Storage) -> None:
    for key in ["p/1", "p/q/2", "p/q/3", "pp/4", "other/5"]:
        storage.put_bytes(key, b"x")
    storage.delete_prefix("p/")
    assert storage.list("") == ["other/5", "pp/4"]
    storage.delete_prefix("nothing/")


def test_iter_range(storage: Storage) -> None:
    data = os.urandom(2 * MiB + 12345)
    storage.put_bytes("r/blob", data)
    size = len(data)

    def read(start: int, end: int) -> bytes:
        return b"".join(storage.iter_range("r/blob", start, end))

    assert read(0, 0) == data[:1]  # end is inclusive
    assert read(10, 19) == data[10:20]
    assert read(size - 1, size - 1) == data[-1:]
    assert read(100, size + 1000) == data[100:]  # an end past the object stops at its last byte
    assert read(size, size + 10) == b""  # nothing past the end
    assert read(20, 10) == b""
    chunks = list(storage.iter_range("r/blob", 0, size - 1))
    assert b"".join(chunks) == data
    assert len(chunks) >= 3  # streamed in chunks, not read whole
    assert max(len(c) for c in chunks) <= MiB


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/./b", "a/../b", "..", ".", "a/"])
def test_invalid_keys_are_rejected(storage: Storage, key: str) -> None:
    with pytest.raises(ValueError, match="invalid storage key"):
        storage.put_bytes(key, b"x")
    with pytest.raises(ValueError, match="invalid storage key"):
        storage.get_bytes(key)
    with pytest.raises(ValueError, match="invalid storage key"):
        storage.exists(key)


def test_overlong_key_part_names_nothing(storage: Storage) -> None:
    key = "k/" + "x" * 256
    with pytest.raises(ObjectNotFound):
        storage.get_bytes(key)
    with pytest.raises(ObjectNotFound):
        storage.put_bytes(key, b"x")
    assert storage.find_json(key) is None


def test_big_file_round_trip(storage: Storage, scratch: Path) -> None:
    """Above the multipart threshold (5 MiB on S3 here): uploaded in parts, read back whole."""
    data = os.urandom(2 * PART + MiB)
    (scratch / "big.bin").write_bytes(data)
    storage.put_file("big/file.bin", scratch / "big.bin")
    assert storage.size("big/file.bin") == len(data)
    storage.download("big/file.bin", scratch / "back.bin")
    assert (scratch / "back.bin").read_bytes() == data
    if isinstance(storage, S3Storage):
        head = storage.client.head_object(Bucket=storage.bucket, Key=storage.prefix + "big/file.bin")
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # S3 marks a 3-part upload so


def test_ping(storage: Storage) -> None:
    storage.ping()


# ---------------------------------------------------------------- S3 only


def test_keys_live_under_the_url_prefix(s3_env: SeaweedServer, s3_bucket: str) -> None:
    storage = open_storage(f"s3://{s3_bucket}/deploy/one", s3_env.endpoint_url)
    assert isinstance(storage, S3Storage)
    assert (storage.bucket, storage.prefix) == (s3_bucket, "deploy/one/")
    storage.put_bytes("models/m.json", b"{}")
    raw = s3_env.client().list_objects_v2(Bucket=s3_bucket, Prefix="deploy/")
    assert [item["Key"] for item in raw["Contents"]] == ["deploy/one/models/m.json"]
    assert storage.list("models/") == ["models/m.json"]
    storage.delete_prefix("")
    assert storage.list("") == []


def test_list_paginates(s3: S3Storage) -> None:
    calls: list[str] = []
    s3.client.meta.events.register("before-call.s3.ListObjectsV2", lambda **_: calls.append("list"))
    keys = sorted(f"page/{i:02d}" for i in range(30))
    for key in keys:
        s3.put_bytes(key, b"")
    assert s3.list("page/") == keys
    assert len(calls) == 5  # ceil(30 / 7) pages


def test_presigned_url_is_fetchable(s3: S3Storage) -> None:
    data = os.urandom(50_000)
    s3.put_bytes("shared/file.bin", data)
    url = s3.presigned_url("shared/file.bin", 60)
    assert "X-Amz-Signature=" in url
    response = httpx.get(url)
    assert response.status_code == 200, response.text
    assert response.content == data
    ranged = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert ranged.status_code == 206
    assert ranged.content == data[10:20]
    tampered = url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    assert httpx.get(tampered).status_code == 403  # the server checks signatures


def test_endpoint_down_raises_storage_unavailable(s3_env: SeaweedServer, scratch: Path) -> None:
    """A closed port: every operation fails fast with StorageUnavailable, never a raw botocore error."""
    client = make_s3_client(f"http://127.0.0.1:{free_port()}", connect_timeout=0.5, max_attempts=1)
    storage = S3Storage(client, "bucket", "prefix/")
    (scratch / "f").write_bytes(b"x")
    operations = {
        "ping": storage.ping,
        "put_bytes": lambda: storage.put_bytes("k", b"x"),
        "put_file": lambda: storage.put_file("k", scratch / "f"),
        "get_bytes": lambda: storage.get_bytes("k"),
        "download": lambda: storage.download("k", scratch / "out"),
        "exists": lambda: storage.exists("k"),
        "size": lambda: storage.size("k"),
        "list": lambda: storage.list(""),
        "delete": lambda: storage.delete("k"),
        "delete_prefix": lambda: storage.delete_prefix(""),
        "iter_range": lambda: list(storage.iter_range("k", 0, 1)),
    }
    for name, operation in operations.items():
        began = time.monotonic()
        with pytest.raises(StorageUnavailable, match="unreachable"):
            operation()
        assert time.monotonic() - began < 5, name


def test_missing_bucket(seaweed: SeaweedServer) -> None:
    storage = S3Storage(seaweed.client(), f"missing-{uuid.uuid4().hex[:8]}")
    with pytest.raises(BucketNotFound):
        storage.ping()
    with pytest.raises(StorageUnavailable):
        storage.get_bytes("k")


def test_wrong_credentials_name_the_s3_error(seaweed: SeaweedServer, s3_bucket: str) -> None:
    wrong = dataclasses.replace(seaweed, secret_key="not-the-secret")
    storage = S3Storage(wrong.client(max_attempts=1), s3_bucket)
    with pytest.raises(RuntimeError, match="SignatureDoesNotMatch") as caught:
        storage.get_bytes("k")
    assert not isinstance(caught.value, StorageUnavailable)


class _Failing(BaseHTTPRequestHandler):
    """Answers every request with an S3-style 500 error."""

    def _fail(self) -> None:
        body = b"<Error><Code>InternalError</Code><Message>disk on fire</Message></Error>"
        self.send_response(500)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _fail

    def log_message(self, *args: Any) -> None:  # keep the test output clean
        pass


@pytest.fixture
def failing_endpoint() -> Iterator[str]:
    """An HTTP server that answers every S3 request with a 500."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_server_errors_raise_storage_unavailable(s3_env: SeaweedServer, failing_endpoint: str) -> None:
    storage = S3Storage(make_s3_client(failing_endpoint, max_attempts=1), "bucket")
    with pytest.raises(StorageUnavailable, match="500 InternalError"):
        storage.get_bytes("k")
    with pytest.raises(StorageUnavailable, match="500"):
        storage.ping()
    with pytest.raises(StorageUnavailable):
        storage.put_bytes("k", json.dumps({}).encode())


def test_s3_outage_and_recovery(seaweed: SeaweedServer, s3_bucket: str) -> None:
    """The real server stops: StorageUnavailable; it starts again on the same port and data: all is back."""
    storage = s3_storage(seaweed, s3_bucket)  # the service's default client: 3 attempts, pooled connections
    storage.put_bytes("kept/object", b"survives a restart")
    stop_seaweed(seaweed)
    try:
        with pytest.raises(StorageUnavailable, match="unreachable"):
            storage.ping()
        with pytest.raises(StorageUnavailable, match="unreachable"):
            storage.get_bytes("kept/object")
    finally:
        restart_seaweed(seaweed)  # updates the session's server in place
    storage.ping()
    assert storage.get_bytes("kept/object") == b"survives a restart"
    storage.put_bytes("kept/after", b"writable again")
    assert storage.list("kept/") == ["kept/after", "kept/object"]
