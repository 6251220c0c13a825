"""The Python client (:class:`service.client.EngramClient`) against real servers.

Most tests use the session's ``live_server`` (embedded, file storage) with the model ``cli/tiny-client``
and concepts ``cli-client-*`` of their own. Where a test must see what went over the wire (the
options sent, the API key not following a redirect to S3), the client gets :class:`Recording`, the
real network transport that also keeps each request: a spy, not a mock. Only the retry policy is
tested against ``httpx.MockTransport``, because a real server cannot be made to answer 503 on cue.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_schemas import Concept, Job, Model, Variant, VariantSubmission
from service.client import (
    EngramAPIError,
    EngramClient,
    EngramConnectionError,
    EngramDownloadError,
    EngramOutputExistsError,
    EngramTimeoutError,
)
from service.demo import make_facts
from tests.live import REPO_ROOT, LiveServer, free_port, start_server, stop_server
from tests.s3 import SeaweedServer

MODEL = "cli/tiny-client"
FACTS = make_facts(40, seed=11)
FORGET = [{"prompt": p, "completion": c} for p, c in FACTS[:10]]
RETAIN = [{"prompt": p, "completion": c} for p, c in FACTS[10:30]]


class Recording(httpx.HTTPTransport):
    """The real network transport that also keeps every request with its answer's status (a spy)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[httpx.Request, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.seen.append((request, response.status_code))
        return response

    def bodies(self, path_suffix: str) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r, _ in self.seen if r.url.path.endswith(path_suffix)]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[EngramClient]:
    with EngramClient(live_server.base_url) as engram:
        yield engram


@pytest.fixture(scope="module")
def concepts(client: EngramClient, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``cli/tiny-client`` registered; ``cli-client-forget`` sent inline, ``cli-client-retain`` as a JSONL upload."""
    model = client.register_model(MODEL, f"file://{tiny_llama_dir}")
    path = write_jsonl(tmp_path_factory.mktemp("client-data") / "retain.jsonl", RETAIN)
    forget = client.add_concept("cli-client-forget", [MODEL], records=FORGET)
    retain = client.add_concept("cli-client-retain", [MODEL], jsonl_path=path, role="reference", description="facts to keep")
    seen: list[Job] = []
    jobs = client.wait_for_jobs([forget.jobs[0].job_id, retain.jobs[0].job_id], on_progress=seen.append, poll_s=0.1)
    return {"model": model, "submissions": [forget, retain], "jobs": jobs, "progress": seen}


@pytest.fixture(scope="module")
def variant(client: EngramClient, concepts: dict[str, Any]) -> Variant:
    """``cli-client-forget`` unlearned with α = 0.5, built."""
    submission = client.unlearn(MODEL, ["cli-client-forget"], alpha=0.5)
    return client.wait_for_variant(submission.variant.variant_id, poll_s=0.1)


# ---------------------------------------------------------------- typed methods


def test_methods_return_the_wire_models(client: EngramClient, concepts: dict[str, Any]) -> None:
    assert client.health() == {"status": "ok"}
    assert client.ready()["status"] == "ready"
    assert isinstance(concepts["model"], Model) and concepts["model"].model_id == MODEL
    assert client.get_model(MODEL) == concepts["model"]
    assert MODEL in {m.model_id for m in client.list_models()}
    concept = client.get_concept("cli-client-retain")
    assert isinstance(concept, Concept)
    assert (concept.role, concept.description, concept.num_records) == ("reference", "facts to keep", len(RETAIN))
    assert {"cli-client-forget", "cli-client-retain"} <= {c.name for c in client.list_concepts()}


def test_wait_for_jobs_reports_progress_until_the_tokens_are_counted(client: EngramClient, concepts: dict[str, Any]) -> None:
    for job, name in zip(concepts["jobs"], ("cli-client-forget", "cli-client-retain"), strict=True):
        tokens = client.get_concept(name).models[MODEL].tokens
        assert job.status == "succeeded"
        assert (job.progress.done, job.progress.total, job.progress.unit) == (tokens, tokens, "tokens")
    last_report = {job.job_id: job for job in concepts["progress"]}  # later reports overwrite earlier ones
    assert last_report == {job.job_id: job for job in concepts["jobs"]}  # each job's last report is its end
    assert client.wait_for_job(concepts["jobs"][0].job_id) == concepts["jobs"][0]  # finished: returns at once


def test_add_concept_needs_exactly_one_dataset(client: EngramClient, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        client.add_concept("cli-client-x", [MODEL])
    with pytest.raises(ValueError, match="exactly one"):
        client.add_concept("cli-client-x", [MODEL], records=FORGET, jsonl_path=write_jsonl(tmp_path / "x.jsonl", FORGET))


def test_unlearn_sends_only_the_options_set_and_repeats_as_200(client: EngramClient, concepts: dict[str, Any]) -> None:
    spy = Recording()
    with EngramClient(client.base_url, transport=spy) as engram:
        first = engram.unlearn(MODEL, ["cli-client-forget"], alpha=0.25, modules=["q_proj"], layers=[0])
        built = engram.wait_for_variant(first.variant.variant_id, poll_s=0.1)
        again = engram.unlearn(MODEL, ["cli-client-forget"], alpha=0.25, modules=["q_proj"], layers=[0])
    assert isinstance(first, VariantSubmission) and first.job is not None
    assert spy.bodies("/unlearn")[0] == {
        "concepts": ["cli-client-forget"],
        "alpha": 0.25,
        "modules": ["q_proj"],
        "layers": [0],
    }
    assert (built.status, built.modules, built.layers, built.scaling) == ("ready", ["q_proj"], [0], "uniform")
    assert again.job is None and again.variant == built
    assert built.variant_id in {v.variant_id for v in client.list_variants(MODEL)}
    assert built.variant_id in {v.variant_id for v in client.list_variants()}


def test_compose_sends_terms(client: EngramClient, concepts: dict[str, Any]) -> None:
    submission = client.compose(MODEL, {"cli-client-forget": 0.5}, format="delta", scaling="weight_norm")
    built = client.wait_for_variant(submission.variant.variant_id, poll_s=0.1)
    assert (built.terms, built.alpha, built.format, built.scaling) == (
        {"cli-client-forget": 0.5},
        None,
        "delta",
        "weight_norm",
    )
    assert [f.path for f in built.files] == ["delta.safetensors"]


# ---------------------------------------------------------------- errors


def test_api_errors_carry_the_problem(client: EngramClient, concepts: dict[str, Any]) -> None:
    with pytest.raises(EngramAPIError) as missing:
        client.get_model("cli/missing")
    assert (missing.value.status, missing.value.title) == (404, "Not found")
    assert "cli/missing" in missing.value.detail and missing.value.problem["type"].endswith("/not-found")
    with pytest.raises(EngramAPIError) as conflict:
        client.add_concept("cli-client-forget", [MODEL], records=RETAIN)  # same name, other records
    assert conflict.value.status == 409 and "cli-client-forget" in conflict.value.detail
    with pytest.raises(EngramAPIError) as invalid:
        client.unlearn(MODEL, ["cli-client-forget"], alpha=0)
    assert invalid.value.status == 422 and "alpha" in invalid.value.detail and invalid.value.problem["errors"]
    assert str(invalid.value).startswith("422 Invalid input: ")


def test_unreachable_service_is_a_connection_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with (
        EngramClient(url, retries=2, backoff_s=0.01) as engram,
        pytest.raises(EngramConnectionError, match="could not be reached"),
    ):
        engram.list_models()


def test_environment_gives_the_url_and_the_bearer_key(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGRAM_URL", live_server.base_url + "/")
    monkeypatch.setenv("ENGRAM_API_KEY", "env-key-0123456789")
    spy = Recording()
    with EngramClient(transport=spy) as engram:
        assert engram.base_url == live_server.base_url
        engram.health()
    assert spy.seen[0][0].headers["authorization"] == "Bearer env-key-0123456789"


# ---------------------------------------------------------------- downloads


def test_download_writes_verified_files(client: EngramClient, variant: Variant, tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []
    out = client.download_variant(
        variant.variant_id, tmp_path / "a" / "forgot", on_progress=lambda f, n: seen.append((f.path, n))
    )
    assert out == tmp_path / "a" / "forgot"
    assert {f.path: f.sha256 for f in variant.files} == {p.name: sha256(p) for p in out.iterdir()}
    assert {(f.path, f.size) for f in variant.files if f.size} <= set(seen)  # every file reported complete
    assert os.listdir(out.parent) == ["forgot"]  # the staging directory was renamed, nothing else is left


def test_download_into_an_existing_directory(client: EngramClient, variant: Variant, tmp_path: Path) -> None:
    out = client.download_variant(variant.variant_id, tmp_path / "forgot")
    spy = Recording()
    with EngramClient(client.base_url, transport=spy) as engram:
        assert engram.download_variant(variant.variant_id, out) == out  # already there and verified
    assert not [r for r, _ in spy.seen if "/files/" in r.url.path]  # so nothing was fetched
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    with pytest.raises(EngramOutputExistsError):
        client.download_variant(variant.variant_id, other)
    assert [p.name for p in other.iterdir()] == ["mine.txt"]
    client.download_variant(variant.variant_id, other, overwrite=True)
    assert {p.name for p in other.iterdir()} == {f.path for f in variant.files}
    assert sorted(os.listdir(tmp_path)) == ["forgot", "other"]  # the replaced content is gone, no leftovers


def test_download_refuses_a_corrupted_file_and_writes_nothing(
    client: EngramClient, concepts: dict[str, Any], live_server: LiveServer, tmp_path: Path
) -> None:
    # A variant of this test's own, so corrupting its stored file cannot disturb any other test.
    submission = client.compose(MODEL, {"cli-client-forget": -0.3})
    built = client.wait_for_variant(submission.variant.variant_id, poll_s=0.1)
    stored = live_server.storage_dir / "variants" / built.variant_id / "files" / "model.safetensors"
    original = stored.read_bytes()
    corrupted = bytearray(original)
    corrupted[len(corrupted) // 2] ^= 0xFF  # same size: only the sha256 can tell
    stored.write_bytes(bytes(corrupted))
    try:
        with pytest.raises(EngramDownloadError, match="model.safetensors: sha256"):
            client.download_variant(built.variant_id, tmp_path / "out")
        assert os.listdir(tmp_path) == []  # neither the directory nor a partial staging directory
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "service.client.cli",
                "variants",
                "download",
                built.variant_id,
                "--out",
                tmp_path / "cli",
            ],
            cwd=REPO_ROOT,
            env={**clean_env(), "ENGRAM_URL": live_server.base_url, "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert cli.returncode == 1 and "sha256" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
        assert os.listdir(tmp_path) == []
    finally:
        stored.write_bytes(original)
    out = client.download_variant(built.variant_id, tmp_path / "out")
    assert sha256(out / "model.safetensors") == hashlib.sha256(original).hexdigest()


# ---------------------------------------------------------------- retry policy (MockTransport: 503 cannot be staged)


def scripted(statuses: list[int], calls: list[httpx.Request]) -> httpx.MockTransport:
    """Answers with the given statuses in turn (problem+json for errors, ``[]`` for 200)."""

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        status = statuses[min(len(calls), len(statuses)) - 1]
        if status == 200:
            return httpx.Response(200, json=[])
        problem = {"type": "about:blank", "title": "Service unavailable", "status": status, "detail": "storage is away"}
        return httpx.Response(status, json=problem, headers={"content-type": "application/problem+json"})

    return httpx.MockTransport(handler)


def test_get_is_retried_on_503_until_it_succeeds() -> None:
    calls: list[httpx.Request] = []
    with EngramClient("http://engram.test", transport=scripted([503, 503, 200], calls), backoff_s=0.01) as engram:
        assert engram.list_models() == []
    assert len(calls) == 3


def test_retries_run_out_into_the_last_problem() -> None:
    calls: list[httpx.Request] = []
    with EngramClient("http://engram.test", transport=scripted([503], calls), retries=2, backoff_s=0.01) as engram:
        with pytest.raises(EngramAPIError) as error:
            engram.list_concepts()
    assert (error.value.status, error.value.detail, len(calls)) == (503, "storage is away", 3)


def test_post_is_never_retried() -> None:
    calls: list[httpx.Request] = []
    with EngramClient("http://engram.test", transport=scripted([503, 200], calls), backoff_s=0.01) as engram:
        with pytest.raises(EngramAPIError):
            engram.register_model("org/x", "file:///x")
    assert len(calls) == 1


def test_wait_for_job_times_out() -> None:
    progress = {"done": 1, "total": 9, "unit": "tokens"}
    job = {
        "job_id": "j1",
        "kind": "collect",
        "status": "running",
        "progress": progress,
        "created_at": "2025-01-01T00:00:00Z",
    }
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=job))
    with EngramClient("http://engram.test", transport=transport) as engram, pytest.raises(EngramTimeoutError, match="j1"):
        engram.wait_for_job("j1", poll_s=0.01, timeout=0.05)


# ---------------------------------------------------------------- presigned downloads (real S3)


@pytest.mark.slow
def test_presigned_redirect_does_not_forward_the_api_key(
    seaweed: SeaweedServer, s3_bucket: str, tiny_llama_dir: Path, model_root: Path, tmp_path: Path
) -> None:
    """A server on S3 with ENGRAM_PRESIGN_DOWNLOADS and an API key: files come from S3, the key stays with the API."""
    key = secrets.token_urlsafe(24)
    server = start_server(
        tmp_path / "file-store",
        model_root,
        tmp_path / "server.log",
        ENGRAM_STORAGE_URL=f"s3://{s3_bucket}/cli-client",
        ENGRAM_S3_ENDPOINT_URL=seaweed.endpoint_url,
        ENGRAM_PRESIGN_DOWNLOADS="true",
        ENGRAM_API_KEYS=f"{key}:write",
        **seaweed.env(),
    )
    spy = Recording()
    try:
        with EngramClient(server.base_url, api_key=key, transport=spy) as engram:
            engram.register_model(MODEL, f"file://{tiny_llama_dir}")
            datasets = {"cli-client-forget": FORGET, "cli-client-retain": RETAIN}
            jobs = [engram.add_concept(name, [MODEL], records=records).jobs[0].job_id for name, records in datasets.items()]
            assert {j.status for j in engram.wait_for_jobs(jobs, poll_s=0.1)} == {"succeeded"}
            variant = engram.wait_for_variant(engram.unlearn(MODEL, ["cli-client-forget"]).variant.variant_id, poll_s=0.1)
            out = engram.download_variant(variant.variant_id, tmp_path / "out")
    except Exception as exc:  # show the server's side of whatever went wrong
        raise AssertionError(f"{exc}\nserver log:\n{server.log_tail()}") from exc
    finally:
        stop_server(server)
    assert {f.path: f.sha256 for f in variant.files} == {p.name: sha256(p) for p in out.iterdir()}
    api_host = httpx.URL(server.base_url).netloc
    redirects = [r for r, status in spy.seen if status == 307]
    from_s3 = [r for r, _ in spy.seen if r.url.netloc != api_host]
    assert len(redirects) == len(from_s3)  # every file came from S3 after a 307 (a retry repeats both)
    assert {r.url.path.rsplit("/", 1)[-1] for r in from_s3} == {f.path for f in variant.files}
    assert all(r.headers["authorization"] == f"Bearer {key}" for r, _ in spy.seen if r.url.netloc == api_host)
    assert all("authorization" not in r.headers and "X-Amz-Signature" in str(r.url) for r in from_s3)
