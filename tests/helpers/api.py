"""What a request to the live API must answer and leave unchanged: a problem+json answer that names
what is wrong, and a block that changes no listing and no stored file; concepts written straight
into a server's storage, for listings to page through; a model registered as a client registers one
(:func:`register_model`: 201, or 202 and its job)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job, wait_idle

PROBLEM_KEYS = {"type", "title", "status", "detail"}
READ_CACHE_S = 1.1  # listings are served as of at most a second ago (service.storage.read_cache)


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def assert_problem(response: httpx.Response, status: int, *mentions: str) -> dict[str, Any]:
    """A problem+json response with the given status whose detail names every ``mentions``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json"), response.headers
    problem = response.json()
    assert problem.keys() >= PROBLEM_KEYS, problem
    assert problem["status"] == status
    assert problem["title"]
    assert problem["detail"]
    assert problem["type"]
    for mention in mentions:
        assert mention in problem["detail"], problem
    return problem


def register_model(
    client: httpx.Client,
    model_id: str,
    source: str,
    *,
    existing_ok: bool = False,
    timeout: float = 600,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``POST /models`` and wait for the registration; the model as ``GET /models/{id}`` then shows it.

    The service answers 201 when its register job finished within the request's wait and 202 with
    the job when it did not (a loaded machine: every test server shares two cores); both are a
    registration started by this request, and a 202's job must succeed. ``existing_ok``: 200 (the
    identical registration was there) passes too. For a test of which of them is answered, post
    and assert the status yourself. ``fields``: more of the request's body (``labels``, ``reason``).
    """
    response = client.post("/models", json={"model_id": model_id, "source": source, **(fields or {})})
    accepted = (200, 201, 202) if existing_ok else (201, 202)
    assert response.status_code in accepted, response.text
    if response.status_code == 202:  # the register job ran past the request's wait
        job = wait_for_job(client, response.json()["job_id"], timeout=timeout)
        assert job["status"] == "succeeded", job
    shown = client.get(f"/models/{model_id}")
    assert shown.status_code == 200, shown.text
    model: dict[str, Any] = shown.json()
    assert model["model_id"] == model_id, model
    return model


def model_with_concepts(
    client: httpx.Client, model_id: str, source: str, concepts: dict[str, tuple[str | None, list[dict[str, Any]]]]
) -> None:
    """``model_id`` registered (:func:`register_model`; 200 too: a module's second registration) and
    each concept (name -> its role, None to leave it out, and records) posted on it (202: a new
    collection) and ready."""
    register_model(client, model_id, source, existing_ok=True)
    for name, (role, records) in concepts.items():
        body = {"name": name, "models": [model_id], "records": records, **({"role": role} if role else {})}
        response = client.post("/concepts", json=body)
        assert response.status_code == 202, response.text
    wait_concepts_ready(client, list(concepts), model_id)


def snapshot(server: LiveServer) -> dict[str, Any]:
    """Everything a request could change: API listings and the files in storage (size, mtime), but
    the audit log's."""
    wait_idle(server)
    api = server.client
    models = api.get("/models").json()
    # audit/: every request that could change something is recorded there, refused ones too, by design
    # (service.api.audit); what a refusal must not change is everything else.
    files = {
        key: (path.stat().st_size, path.stat().st_mtime_ns)
        for path in server.storage_dir.rglob("*")
        if path.is_file() and not (key := path.relative_to(server.storage_dir).as_posix()).startswith("audit/")
    }
    return {
        "models": sorted(models, key=lambda m: m["model_id"]),
        "concepts": sorted(api.get("/concepts").json(), key=lambda c: c["name"]),
        "variants": {m["model_id"]: api.get(f"/models/{m['model_id']}/variants").json() for m in models},
        "files": files,
    }


@contextmanager
def unchanged(server: LiveServer) -> Iterator[None]:
    """Assert the block changes no listing and no stored file."""
    before = snapshot(server)
    yield
    after = snapshot(server)
    old, new = before["files"], after["files"]
    assert new == old, {
        "added": sorted(new.keys() - old.keys()),
        "removed": sorted(old.keys() - new.keys()),
        "modified": sorted(k for k in old.keys() & new.keys() if old[k] != new[k]),
    }
    assert after == before


def write_concept(server: LiveServer, name: str) -> None:
    """A concept document written straight into the server's storage (no job): listings to page through."""
    folder = server.storage_dir / "concepts"
    folder.mkdir(parents=True, exist_ok=True)
    document = {
        "format_version": 1,  # service.models.stored.FORMAT_VERSION: readers refuse a concept without it
        "name": name,
        "role": "target",
        "description": None,
        "num_records": 1,
        "dataset_digest": "0" * 64,
        "models": {},
        "created_at": "2026-01-01T00:00:00+00:00",
    }
    (folder / f"{name}.json").write_text(json.dumps(document))
