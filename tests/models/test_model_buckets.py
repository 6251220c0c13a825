"""``s3://`` models come only from buckets ``ENGRAM_MODEL_BUCKETS`` lists (issue 35, finding 7).

A write key could register a model from any bucket the service's credentials read (another team's)
and download its weights in a variant. Against a real server on a real S3 server (SeaweedFS): a
model in an unlisted bucket, or anywhere in the store's own bucket, is a 422 naming the bucket and
the setting, answered before anything is listed or downloaded (no job, no cached copy, no key in
the store); the same checkpoint in a listed bucket registers. The jobs check again with their own
settings (a worker started otherwise, a bucket delisted after registration), before reading S3.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from engram_fixtures.live import LiveServer, free_port, start_server, stop_server
from service.config import Settings
from service.context import Context
from service.errors import InvalidInput
from service.models.inspection import register_model
from service.models.loaded import checked_model_files
from service.models.record import ModelLayout, ModelRecord
from service.storage.local import LocalStorage
from tests.helpers.api import assert_problem
from tests.helpers.s3 import SeaweedServer, drop_bucket, new_bucket

PREFIX = "engram"


@pytest.fixture(scope="module")
def buckets(seaweed: SeaweedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The store's bucket, a listed one and an unlisted one, each holding the same tiny Llama under ``tiny/``."""
    from engram_fixtures.models import make_tiny_llama

    model = tmp_path_factory.mktemp("bucket-model") / "tiny"
    make_tiny_llama(model, hidden=32, layers=2, tie_word_embeddings=True)
    names = {role: new_bucket(seaweed, role) for role in ("store", "listed", "unlisted")}
    client = seaweed.client()
    for bucket in names.values():
        for path in sorted(model.iterdir()):
            client.put_object(Bucket=bucket, Key=f"tiny/{path.name}", Body=path.read_bytes())
    try:
        yield names
    finally:
        for bucket in names.values():
            drop_bucket(seaweed, bucket)


@pytest.fixture(scope="module")
def server(
    seaweed: SeaweedServer, buckets: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("model-buckets")
    (root / "models").mkdir()
    live = start_server(
        root / "file-store",
        root / "models",
        root / "server.log",
        ENGRAM_STORAGE_URL=f"s3://{buckets['store']}/{PREFIX}",
        ENGRAM_S3_ENDPOINT_URL=seaweed.endpoint_url,
        ENGRAM_MODEL_BUCKETS=buckets["listed"],
        ENGRAM_CACHE_DIR=str(root / "cache"),
        **seaweed.env(),
    )
    try:
        yield live
    finally:
        stop_server(live)


def _store_keys(seaweed: SeaweedServer, bucket: str) -> list[str]:
    pages = seaweed.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{PREFIX}/")
    keys = (item["Key"] for page in pages for item in page.get("Contents", []))
    return sorted(key for key in keys if not key.startswith(f"{PREFIX}/audit/"))  # the audit log records refusals


def _cached_copies(server: LiveServer) -> list[Path]:
    """The s3:// model copies the server's job process downloaded (ENGRAM_CACHE_DIR/s3/)."""
    cache = server.storage_dir.parent / "cache" / "s3"
    return sorted(cache.iterdir()) if cache.is_dir() else []


@pytest.mark.parametrize(("role", "names"), [("unlisted", "ENGRAM_MODEL_BUCKETS"), ("store", "ENGRAM_STORAGE_URL")])
def test_a_model_from_a_bucket_not_listed_is_422_and_downloads_nothing(
    server: LiveServer, seaweed: SeaweedServer, buckets: dict[str, str], role: str, names: str
) -> None:
    """The store's bucket is refused even outside the store's prefix (``tiny/``), naming ENGRAM_STORAGE_URL."""
    api = server.client
    before = _store_keys(seaweed, buckets["store"])
    copies = _cached_copies(server)
    body = {"model_id": f"bucket/{role}", "source": f"s3://{buckets[role]}/tiny/"}
    refused = api.post("/models", params={"wait": 0}, json=body)
    assert_problem(refused, 422, buckets[role], names)
    assert "job_id" not in refused.json(), "a refused registration starts no job"
    assert api.get(f"/models/bucket/{role}").status_code == 404
    assert not [job for job in api.get("/jobs").json() if job.get("model_id") == f"bucket/{role}"]
    assert _cached_copies(server) == copies, "nothing was downloaded"
    assert _store_keys(seaweed, buckets["store"]) == before, "nothing was written to the store"


def test_a_model_from_a_listed_bucket_registers(server: LiveServer, buckets: dict[str, str]) -> None:
    source = f"s3://{buckets['listed']}/tiny/"
    registered = server.client.post("/models", params={"wait": 60}, json={"model_id": "bucket/listed", "source": source})
    assert registered.status_code == 201, registered.text
    assert registered.json()["source"] == source
    copy = hashlib.sha256(source.encode()).hexdigest()
    assert copy in [path.name for path in _cached_copies(server)]


# ---------------------------------------------------------------- the jobs check again, before S3 is read


def _context(tmp_path: Path, **settings: str) -> Context:
    # An endpoint nobody listens on: a check that came after an S3 call would fail as unreachable (503), not 422.
    unreachable = f"http://127.0.0.1:{free_port()}"
    options = Settings(cache_dir=tmp_path / "cache", s3_endpoint_url=unreachable, **settings)  # type: ignore[arg-type]
    store, lock = LocalStorage(tmp_path / "store"), threading.RLock()
    return Context(settings=options, storage=store, jobs=None, dispatch=None, lock=lock)  # type: ignore[arg-type]


def test_a_register_job_refuses_an_unlisted_bucket_before_reading_it(tmp_path: Path) -> None:
    """A job queued by an API with other settings (or before a restart that delisted the bucket)."""
    ctx = _context(tmp_path, model_buckets="models-a")
    with pytest.raises(InvalidInput, match="'models-b'.*ENGRAM_MODEL_BUCKETS: models-a"):
        register_model(ctx, "bucket/job", "s3://models-b/tiny/")
    assert not (tmp_path / "cache").exists() and not list((tmp_path / "store").rglob("*.json"))


def test_a_registered_model_from_a_bucket_delisted_since_is_not_read(tmp_path: Path) -> None:
    """A job on a model registered while its bucket was listed: the bucket is checked before a download."""
    ctx = _context(tmp_path)
    manifest = ModelRecord(
        model_id="bucket/delisted",
        source="s3://models-a/tiny/",
        path=str(tmp_path / "cache" / "s3" / "copy"),
        digest="0" * 64,
        file_sha256={},
        architecture="LlamaForCausalLM",
        num_parameters=0,
        layout=ModelLayout("LlamaForCausalLM", 0, [], {}, {}),  # not read by the check
    )
    with pytest.raises(InvalidInput, match="'models-a'.*ENGRAM_MODEL_BUCKETS: none"):
        checked_model_files(ctx, manifest)


# ---------------------------------------------------------------- the setting


def test_the_setting_is_refused_at_start_up_when_it_lists_the_store_or_a_non_bucket() -> None:
    with pytest.raises(ValidationError, match="ENGRAM_MODEL_BUCKETS lists 'engram-store'"):
        Settings(storage_url="s3://engram-store/prefix", model_buckets="models-a, engram-store")
    with pytest.raises(ValidationError, match="ENGRAM_MODEL_BUCKETS: 'Bad_Name' is not a bucket name"):
        Settings(model_buckets="models-a,Bad_Name")
    assert Settings(model_buckets=" models-a , models-b ").model_bucket_names == {"models-a", "models-b"}
    assert Settings().model_bucket_names == frozenset()  # deny by default
