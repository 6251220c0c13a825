"""API-key auth (``ENGRAM_API_KEYS``): the parser, the scope table, and the app with three keys.

The app here is this module's own (its own storage and model root), started with a ``read``, a
``write`` and an ``admin`` key and called in this process (``tests.helpers.app``): what a key may
do is the app's answer. The server process itself is started for what only it shows: invalid keys
stopping it at start-up, and its log never holding a key. Keys are random per run, so finding one
in the server log means it was really logged.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engram_fixtures.live import LiveServer, start_server, stop_server
from service.api.auth import parse_api_keys, required_scope
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer, another_client, in_process_server

PROBLEM_JSON = "application/problem+json"


def _key() -> str:
    return secrets.token_urlsafe(24)  # 32 characters


@dataclass
class AuthWorld:
    server: InProcessServer | LiveServer
    read: str
    write: str
    admin: str
    wrong: str
    model_dir: Path

    @property
    def api(self) -> httpx.Client:
        return self.server.client

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def secrets(self) -> list[str]:
        return [self.read, self.write, self.admin, self.wrong]


def _keyed_root(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[Path, Path, list[str]]:
    """A fresh root with a tiny Llama inside its model root, and a read, a write and an admin key."""
    from engram_fixtures.models import make_tiny_llama

    root = tmp_path_factory.mktemp(name)
    model_dir = make_tiny_llama(root / "models" / "tiny-llama", hidden=32, layers=2, tie_word_embeddings=True)
    return root, model_dir, [_key(), _key(), _key()]


def _keys_setting(read: str, write: str, admin: str) -> str:
    return f"{read}:read, {write}:write,{admin}:admin"


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthWorld]:
    """The app with one key per scope, called in this process, and a tiny Llama inside its model root."""
    root, model_dir, (read, write, admin) = _keyed_root(tmp_path_factory, "auth")
    with in_process_server(root, root / "models", ENGRAM_API_KEYS=_keys_setting(read, write, admin)) as server:
        yield AuthWorld(server, read, write, admin, _key(), model_dir)


@pytest.fixture(scope="module")
def live_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthWorld]:
    """The server process with one key per scope: its log is what a key must never reach."""
    root, model_dir, (read, write, admin) = _keyed_root(tmp_path_factory, "live-auth")
    keys = _keys_setting(read, write, admin)
    server = start_server(root / "store", root / "models", root / "server.log", ENGRAM_API_KEYS=keys)
    try:
        yield AuthWorld(server, read, write, admin, _key(), model_dir)
    finally:
        stop_server(server)


def assert_problem(response: httpx.Response, status: int, world: AuthWorld) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    body = response.json()
    assert body["status"] == status
    assert {"type", "title", "detail"} <= body.keys()
    for key in world.secrets():
        assert key not in response.text
        assert key not in str(response.headers)
    return body


# ---------------------------------------------------------------- the parser (no server)


@pytest.mark.fast
def test_parse_api_keys_accepts_valid_entries() -> None:
    a, b, c = "a" * 16, "B-_.~+/=0123456789", "x:y" + "z" * 16  # the scope follows the last colon
    assert parse_api_keys(f" {a}:read ,{b}:WRITE,{c}:admin") == {a: "read", b: "write", c: "admin"}


SECRET = "s3cr3t-k3y-do-not-print"


@pytest.mark.fast
@pytest.mark.parametrize(
    ("raw", "index"),
    [
        pytest.param(f"{SECRET}", 1, id="no-colon"),
        pytest.param(f"{SECRET}:root", 1, id="unknown-scope"),
        pytest.param(f"read:{SECRET}", 1, id="swapped"),
        pytest.param(f"{SECRET}:read,short:write", 2, id="short-key"),
        pytest.param(f"{SECRET}:read,,{SECRET}x:admin", 2, id="empty-entry"),
        pytest.param(f"{SECRET}:read,{SECRET}x:write,", 3, id="trailing-comma"),
        pytest.param(f"{SECRET}:read,{SECRET} x:write", 2, id="space-in-key"),
        pytest.param(f"{SECRET}:read,{SECRET}é:write", 2, id="non-ascii-key"),
        pytest.param(f"{SECRET}:read,{SECRET}:admin", 2, id="duplicate"),
        pytest.param(":read", 1, id="empty-key"),
    ],
)
def test_parse_api_keys_rejects_bad_entries_without_echoing_them(raw: str, index: int) -> None:
    with pytest.raises(ValueError, match=rf"entry {index}\b") as caught:
        parse_api_keys(raw)
    message = str(caught.value)
    assert SECRET not in message
    assert "s3cr3t" not in message
    assert caught.value.__cause__ is None and caught.value.__context__ is None


@pytest.mark.fast
@pytest.mark.parametrize("raw", ["", "   "])
def test_parse_api_keys_rejects_an_empty_setting(raw: str) -> None:
    with pytest.raises(ValueError, match="empty"):
        parse_api_keys(raw)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("method", "path", "scope"),
    [
        ("GET", "/healthz", None),
        ("GET", "/readyz", None),
        ("GET", "/models", "read"),
        ("HEAD", "/variants/v/files/config.json", "read"),
        ("GET", "/docs", "read"),
        ("GET", "/openapi.json", "read"),
        ("GET", "/metrics", "read"),
        ("GET", "/nope", "read"),
        ("POST", "/models", "write"),
        ("POST", "/models/org/x/unlearn", "write"),
        ("POST", "/models/org/x/compose", "write"),
        ("POST", "/concepts", "write"),
        ("DELETE", "/concepts/c", "write"),
        ("DELETE", "/variants/v", "write"),
        ("DELETE", "/jobs/j", "admin"),
        ("POST", "/jobs/j", "admin"),
        ("PUT", "/models", "admin"),
        ("POST", "/modelsx", "admin"),
        ("POST", "/healthz/x", "admin"),
        ("OPTIONS", "/models", "admin"),
    ],
)
def test_required_scope(method: str, path: str, scope: str | None) -> None:
    assert required_scope(method, path) == scope


def test_invalid_keys_stop_the_server_at_startup_without_printing_them(tmp_path: Path) -> None:
    good = _key()
    (tmp_path / "models").mkdir()
    with pytest.raises(RuntimeError, match="exited") as caught:
        start_server(
            tmp_path / "store",
            tmp_path / "models",
            tmp_path / "server.log",
            ENGRAM_API_KEYS=f"{good}:read,{SECRET}:superuser",
        )
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "ENGRAM_API_KEYS entry 2 of 2" in log
    assert SECRET not in log and good not in log and SECRET not in str(caught.value)


# ---------------------------------------------------------------- the live server


@pytest.mark.fast
def test_public_probes_need_no_key(auth: AuthWorld) -> None:
    assert auth.api.get("/healthz").status_code == 200
    assert auth.api.get("/readyz").status_code == 200


@pytest.mark.fast
@pytest.mark.parametrize("path", ["/models", "/docs", "/openapi.json", "/metrics", "/jobs/x", "/no-such-route"])
def test_no_key_is_401_with_a_bearer_challenge(auth: AuthWorld, path: str) -> None:
    response = auth.api.get(path)
    body = assert_problem(response, 401, auth)
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "Bearer" in body["detail"]


@pytest.mark.fast
@pytest.mark.parametrize(
    "header",
    [
        pytest.param("wrong", id="wrong-key"),
        pytest.param("Bearer", id="bearer-nothing"),
        pytest.param("Basic {read}", id="basic-scheme"),
        pytest.param("{read}", id="no-scheme"),
        pytest.param("Bearer {read}x", id="key-plus-one"),
        pytest.param("Bearer {read_prefix}", id="key-prefix"),
    ],
)
def test_invalid_credentials_are_401(auth: AuthWorld, header: str) -> None:
    value = "Bearer " + auth.wrong if header == "wrong" else header.format(read=auth.read, read_prefix=auth.read[:-1])
    response = auth.api.get("/models", headers={"Authorization": value})
    assert_problem(response, 401, auth)
    assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.fast
def test_two_authorization_headers_are_401(auth: AuthWorld) -> None:
    headers = [("Authorization", f"Bearer {auth.admin}"), ("Authorization", f"Bearer {auth.read}")]
    assert_problem(auth.api.get("/models", headers=headers), 401, auth)


@pytest.mark.fast
def test_read_key_can_read(auth: AuthWorld) -> None:
    headers = auth.headers(auth.read)
    response = auth.api.get("/models", headers=headers)
    assert response.status_code == 200, response.text
    assert isinstance(response.json(), list)
    assert auth.api.head("/models", headers=headers).status_code not in (401, 403)  # HEAD is read (routes: 405)
    assert auth.api.head("/models").status_code == 401
    assert auth.api.get("/openapi.json", headers=headers).status_code == 200
    assert auth.api.get("/docs", headers=headers).status_code == 200
    assert auth.api.get("/models", headers={"Authorization": f"bearer {auth.read}"}).status_code == 200  # scheme: any case
    assert_problem(auth.api.get("/jobs/nope", headers=headers), 404, auth)  # past auth: the route answers


@pytest.mark.fast
def test_read_key_cannot_write_and_nothing_is_stored(auth: AuthWorld) -> None:
    headers = auth.headers(auth.read)
    body = {"model_id": "acme/read-only", "source": f"file://{auth.model_dir}"}
    response = auth.api.post("/models", json=body, headers=headers)
    problem = assert_problem(response, 403, auth)
    assert "write" in problem["detail"]
    assert "insufficient_scope" in response.headers["www-authenticate"]
    assert_problem(auth.api.delete("/concepts/anything", headers=headers), 403, auth)
    assert_problem(auth.api.post("/concepts", json={}, headers=headers), 403, auth)  # 403 before the body is validated
    listed = auth.api.get("/models", headers=auth.headers(auth.admin)).json()
    assert all(m["model_id"] != "acme/read-only" for m in listed)
    assert not (auth.server.storage_dir / "models").exists() or not any((auth.server.storage_dir / "models").iterdir())


@pytest.mark.fast
def test_write_key_registers_a_model_but_cannot_cancel_jobs(auth: AuthWorld) -> None:
    headers = auth.headers(auth.write)
    body = {"model_id": "acme/tiny", "source": f"file://{auth.model_dir}"}
    response = auth.api.post("/models", json=body, headers=headers)
    assert response.status_code == 201, response.text
    assert response.json()["model_id"] == "acme/tiny"
    assert auth.api.get("/models/acme/tiny", headers=auth.headers(auth.read)).status_code == 200
    # write reaches the edit routes (past auth, the handler answers: no such concept)
    unlearn = auth.api.post("/models/acme/tiny/unlearn", json={"concepts": ["nope"]}, headers=headers)
    assert unlearn.status_code not in (401, 403), unlearn.text
    assert_problem(auth.api.delete("/concepts/nope", headers=headers), 404, auth)
    assert_problem(auth.api.delete("/jobs/x", headers=headers), 403, auth)


@pytest.mark.fast
def test_admin_key_is_allowed_everything(auth: AuthWorld) -> None:
    headers = auth.headers(auth.admin)
    assert auth.api.get("/models", headers=headers).status_code == 200
    again = auth.api.post("/models", json={"model_id": "acme/tiny", "source": f"file://{auth.model_dir}"}, headers=headers)
    assert again.status_code in (200, 201), again.text
    assert_problem(auth.api.delete("/jobs/x", headers=headers), 404, auth)  # past auth: no such job
    assert auth.api.get("/metrics", headers=headers).status_code == 200


def test_keys_never_reach_the_server_log(live_auth: AuthWorld) -> None:
    auth = live_auth
    assert isinstance(auth.server, LiveServer)
    for key in auth.secrets():  # failed and successful attempts with every key
        auth.api.get("/models", headers=auth.headers(key))
        auth.api.delete("/jobs/x", headers=auth.headers(key))
        auth.api.get("/models", headers={"Authorization": f"Basic {key}"})
    log = auth.server.log_path.read_text(errors="replace")
    assert "GET /models" in log  # the access log is there, so the check below means something
    assert "API key auth enabled: 3 keys" in log
    for key in auth.secrets():
        assert key not in log


# ---------------------------------------------------------------- a read key never starts work


def _stored_files(root: Path) -> dict[str, int]:
    """Every file of the server's storage with its modification time: what a write would change."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def mapped(auth: AuthWorld) -> str:
    """A model with two ready concepts, registered and collected with the write key; its ID."""
    from engram_fixtures.demo import make_facts
    from engram_fixtures.live import wait_concepts_ready

    model = "acme/mapped"
    write = another_client(auth.server, auth.headers(auth.write))
    register_model(write, model, f"file://{auth.model_dir}", existing_ok=True)
    facts = make_facts(12, seed=7)
    for name, role, part in (("auth-a", "target", facts[:4]), ("auth-ref", "reference", facts[4:])):
        records = [{"prompt": p, "completion": c} for p, c in part]
        body = {"name": name, "role": role, "models": [model], "records": records}
        assert write.post("/concepts", json=body).status_code == 202
    wait_concepts_ready(write, ["auth-a", "auth-ref"], model)
    return model


def test_a_read_key_asking_for_a_new_map_gets_a_403_and_no_job(auth: AuthWorld, mapped: str) -> None:
    """Issue 23, finding 4: every new ``rcond`` a read key asked for queued a map job (30 requests,
    30 jobs). Now a map nobody computed yet is a 403 naming the write key, and nothing is written;
    the write key's same request computes it, and the read key then reads it."""
    admin, read = auth.headers(auth.admin), auth.headers(auth.read)
    path = f"/models/{mapped}/engram-map"
    before_jobs = auth.api.get("/jobs", headers=admin).json()
    before = _stored_files(auth.server.storage_dir)
    for index in range(5):
        params = {"concepts": "auth-a", "rcond": f"1e-{index + 3}", "wait": "0"}
        problem = assert_problem(auth.api.get(path, params=params, headers=read), 403, auth)
        assert "write" in problem["detail"] and "not computed yet" in problem["detail"]
        assert_problem(auth.api.get(path + ".png", params=params, headers=read), 403, auth)
    assert auth.api.get("/jobs", headers=admin).json() == before_jobs
    assert _stored_files(auth.server.storage_dir) == before  # no job record, no map request, nothing

    params = {"concepts": "auth-a", "rcond": "1e-3", "wait": "60"}
    computed = auth.api.get(path, params=params, headers=auth.headers(auth.write))
    assert computed.status_code == 200, computed.text
    again = auth.api.get(path, params=params, headers=read)  # stored now: a read
    assert again.status_code == 200, again.text
    assert again.json() == computed.json()
    png = auth.api.get(path + ".png", params=params, headers=read)
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"


def test_no_get_route_writes_with_a_read_key(auth: AuthWorld, mapped: str) -> None:
    """The audit of finding 4: every GET route, asked with a read key in every way that could start
    work (a map of a new cut or measure, listings, usage, files), leaves the storage as it was."""
    read = auth.headers(auth.read)
    before = _stored_files(auth.server.storage_dir)
    paths = [
        "/models",
        f"/models/{mapped}",
        f"/models/{mapped}/variants",
        f"/models/{mapped}/universes",
        "/concepts",
        "/concepts/auth-a",
        "/jobs",
        "/variants",
        "/universes/usage",
        f"/universes/usage?model_id={mapped}",
        f"/models/{mapped}/engram-map?concepts=auth-a&measure=weight&wait=0",
        f"/models/{mapped}/engram-map.png?concepts=auth-a,auth-ref&rcond=0.5&wait=0",
        "/metrics",
        "/readyz",
    ]
    for path in paths:
        response = auth.api.get(path, headers=read)
        assert response.status_code in (200, 403, 404), (path, response.text)
    assert _stored_files(auth.server.storage_dir) == before
