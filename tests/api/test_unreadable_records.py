"""One malformed record in the store breaks no listing and no migration (issue 35, finding 10).

Each malformed form the red team stored (a JSON array, a number, bytes that are not UTF-8, JSON
nested past Python's recursion limit, a truncated write) is put where each kind of record lives:
a model registration, a concept, a variant request, a universe request, a job record. Against a
real store (the app in process over file storage, with a real tiny model, two concepts, a universe
and a variant built by the real job bodies; and SeaweedFS for S3):

- every list route answers 200 with every readable item, the bad one left out and named in a
  structured warning (before: ``GET /concepts`` was a 500 for every caller);
- reading the bad record itself answers a 503 problem naming its storage key and why (as every
  other unreadable stored record does: an unmigrated one, a malformed manifest or job record);
- ``engram-service migrate`` (a real process) refuses each by key and why, migrates the others,
  and exits 1 with its summary (before: a traceback at the first one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engram_fixtures.live import REPO_ROOT
from service.storage.base import Storage
from service.storage.factory import open_storage
from service.storage.keys import (
    OPEN_JOBS,
    concept_key,
    current_pointer_key,
    job_key,
    known_universe_key,
    model_key,
    universe_request_key,
    variant_request_key,
)
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.s3 import SeaweedServer
from tests.helpers.store_world import StoreWorld, text_records
from tests.helpers.variants import build

MODEL = "tiny/m"
DEEP = 100_000  # levels of nesting: far past the decoder's recursion limit (about 1,000)
# Each malformed form, as stored, and what the refusal says it is.
FORMS: dict[str, tuple[bytes, str]] = {
    "array": (b'["a", "record"]', "JSON array, not an object"),
    "number": (b"42", "JSON number, not an object"),
    "non-utf8": (b'{"name": "\xff\xfe"}', "not UTF-8"),
    "deep": (b'{"name": ' + b"[" * DEEP + b"]" * DEEP + b"}", "nested too deeply"),
    "truncated": (b'{"format_version": 1, "name": "cut", "ro', "not JSON"),
}


def ids_of(form: str) -> str:
    """A 32-hex-digit ID of the form's own (valid as a variant, universe and job ID)."""
    return hashlib.md5(form.encode()).hexdigest()  # noqa: S324 (a name, not a digest of anything)


def bad_keys(form: str) -> dict[str, str]:
    """What each kind's bad record is read by: the route of the record itself -> its storage key."""
    uid = ids_of(form)
    return {
        f"/models/bad-{form}": model_key(f"bad-{form}"),
        f"/concepts/bad-{form}": concept_key(f"bad-{form}"),
        f"/variants/{uid}": variant_request_key(uid),
        f"/universes/{uid}": universe_request_key(uid),
        f"/jobs/{uid}": job_key(uid),
    }


def store_bad_records(storage: Storage, form: str) -> None:
    raw, _ = FORMS[form]
    for key in bad_keys(form).values():
        storage.put_bytes(key, raw)
    uid = ids_of(form)
    storage.put_bytes(known_universe_key(MODEL, uid), b"")  # listed among the model's universes
    storage.put_bytes(OPEN_JOBS + uid, b"")  # an open job, as a restarted process finds it


def drop_bad_records(storage: Storage, form: str) -> None:
    for key in bad_keys(form).values():
        storage.delete(key)
    storage.delete(known_universe_key(MODEL, ids_of(form)))
    storage.delete(OPEN_JOBS + ids_of(form))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A store with one readable record of each kind, built by the real service functions and job bodies."""
    root = tmp_path_factory.mktemp("unreadable")
    w = StoreWorld(root)
    w.tiny_llama(MODEL, {"alpha": text_records(0, 12), "beta": text_records(12, 24)})
    variant = build(w, MODEL, {"alpha": -1.0})
    return {"root": root, "world": w, "variant": variant.variant_id, "universe": variant.universe_id}


@pytest.fixture(scope="module")
def server(world: dict[str, Any]) -> Iterator[InProcessServer]:
    root = world["root"]
    with in_process_server(root, root / "models") as live:
        yield live


def listed(server: InProcessServer, path: str, field: str) -> list[str]:
    response = server.client.get(path, params={"limit": 500})
    assert response.status_code == 200, f"GET {path}: {response.status_code} {response.text[:500]}"
    return [item[field] for item in response.json()]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_list_leaves_one_unreadable_record_out_and_names_it(
    server: InProcessServer, world: dict[str, Any], form: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage = world["world"].ctx.storage
    store_bad_records(storage, form)
    try:
        time.sleep(1.1)  # past the API's one-second listing cache: the bad records are listed
        caplog.set_level(logging.WARNING, logger="engram")
        assert MODEL in listed(server, "/models", "model_id")
        assert {"alpha", "beta"} <= set(listed(server, "/concepts", "name"))
        assert world["variant"] in listed(server, "/variants", "variant_id")
        assert world["variant"] in listed(server, f"/models/{MODEL}/variants", "variant_id")
        assert listed(server, f"/models/{MODEL}/universes", "universe_id") == [world["universe"]]
        listed(server, "/jobs", "job_id")
        named = {getattr(r, "record_key", None) for r in caplog.records if r.levelno == logging.WARNING}
        for route in ("/models/", "/concepts/", "/variants/", "/universes/"):
            key = next(k for path, k in bad_keys(form).items() if path.startswith(route))
            assert key in named, f"no warning named {key} (left out of a listing): {sorted(map(str, named))}"
    finally:
        drop_bad_records(storage, form)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_reading_the_unreadable_record_is_a_503_naming_its_key_and_why(
    server: InProcessServer, world: dict[str, Any], form: str
) -> None:
    storage = world["world"].ctx.storage
    store_bad_records(storage, form)
    try:
        for path, key in bad_keys(form).items():
            response = server.client.get(path)
            assert response.status_code == 503, f"GET {path}: {response.status_code} {response.text[:300]}"
            assert response.headers["content-type"].startswith("application/problem+json")
            detail = response.json()["detail"]
            subject = key if not path.startswith("/jobs/") else ids_of(form)  # a job is named by its ID
            assert subject in detail and FORMS[form][1] in detail, f"GET {path}: {detail}"
    finally:
        drop_bad_records(storage, form)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_an_unreadable_current_pointer_marks_no_universe_current_and_is_named(
    server: InProcessServer, world: dict[str, Any], form: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage, key = world["world"].ctx.storage, current_pointer_key(MODEL)
    kept = storage.get_bytes(key)
    storage.put_bytes(key, FORMS[form][0])
    try:
        caplog.set_level(logging.WARNING, logger="engram")
        response = server.client.get(f"/models/{MODEL}/universes")
        assert response.status_code == 200, response.text[:300]
        assert [(u["universe_id"], u["current"]) for u in response.json()] == [(world["universe"], False)]
        assert key in {getattr(r, "record_key", None) for r in caplog.records}
    finally:
        storage.put_bytes(key, kept)


# ---------------------------------------------------------------- engram-service migrate


def old_format(record: dict[str, Any]) -> bytes:
    """A record as 0.1.0 stored it: without ``format_version`` (what migrate rewrites)."""
    return json.dumps({k: v for k, v in record.items() if k != "format_version"}).encode()


def migrate(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")} | env
    command = [sys.executable, "-m", "service.cli", "migrate"]
    return subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=300)


def check_migration(storage: Storage, result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr[-3000:])
    refused = [line for line in result.stderr.splitlines() if line.startswith("refused ")]
    for form, (_, why) in FORMS.items():
        for path, key in bad_keys(form).items():
            if path.startswith("/jobs/"):
                continue  # migrate rewrites no job record (a job record is read as version 1, rewritten on change)
            assert any(line.startswith(f"refused {key}:") and why in line for line in refused), (key, refused)
    assert f"migrated {concept_key('old')}" in result.stdout, result.stdout
    assert storage.get_json(concept_key("old"))["format_version"] == 1, "the readable record was migrated"
    assert f"1 record(s) migrated, {len(refused)} refused" in result.stderr, result.stderr[-500:]
    assert len(refused) == 4 * len(FORMS)


def test_migrate_refuses_each_unreadable_record_by_name_and_migrates_the_rest(world: dict[str, Any], tmp_path: Path) -> None:
    from service.storage.local import LocalStorage

    storage = LocalStorage(tmp_path / "store")
    storage.put_bytes(concept_key("old"), old_format(world["world"].ctx.storage.get_json(concept_key("alpha"))))
    for form in FORMS:
        store_bad_records(storage, form)
    check_migration(storage, migrate({"ENGRAM_STORAGE_URL": f"file://{tmp_path / 'store'}"}))


# ---------------------------------------------------------------- the same on S3 (SeaweedFS)


def test_on_s3_a_listing_and_migrate_survive_each_unreadable_record(
    world: dict[str, Any], seaweed: SeaweedServer, s3_bucket: str, s3_env: SeaweedServer, tmp_path: Path
) -> None:
    url = f"s3://{s3_bucket}/unreadable"
    storage = open_storage(url, seaweed.endpoint_url)
    alpha = world["world"].ctx.storage.get_json(concept_key("alpha"))
    storage.put_json(concept_key("alpha"), alpha)
    for form in FORMS:
        store_bad_records(storage, form)
    env = {"ENGRAM_STORAGE_URL": url, "ENGRAM_S3_ENDPOINT_URL": seaweed.endpoint_url}
    with in_process_server(tmp_path, tmp_path / "models", **env) as live:
        assert listed(live, "/concepts", "name") == ["alpha"]
        for form, (_, why) in FORMS.items():
            response = live.client.get(f"/concepts/bad-{form}")
            assert response.status_code == 503 and why in response.json()["detail"], response.text[:300]
    storage.put_bytes(concept_key("old"), old_format(alpha))
    check_migration(storage, migrate({**env, **seaweed.env()}))
