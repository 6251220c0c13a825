"""The Python client (:class:`engram_client.EngramClient`) against real servers.

Most tests use the session's ``live_server`` (embedded, file storage) with the model ``cli/tiny-client``
and concepts ``cli-client-*`` of their own; evaluation, generation and maps use the ``cli2`` variant
of ``conftest.py``. Where a test must see what went over the wire (the options sent, the API key not
following a redirect to S3), the client gets :class:`Recording`, the real network transport that
also keeps each request: a spy, not a mock. Only the retry policy is
tested against ``httpx.MockTransport``, because a real server cannot be made to answer 503 on cue,
and the refusal of a job of another kind than asked (the real server's answer, its kind rewritten).
"""

from __future__ import annotations

import hashlib
import io
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
from PIL import Image

from api_schemas import (
    Concept,
    EngramMap,
    EvaluateJob,
    EvaluationResult,
    GenerateJob,
    GenerationResult,
    Health,
    Job,
    Model,
    Readiness,
    Variant,
    VariantSubmission,
)
from engram_client import (
    EngramAPIError,
    EngramClient,
    EngramConnectionError,
    EngramDownloadError,
    EngramError,
    EngramJobError,
    EngramOutputExistsError,
    EngramTimeoutError,
)
from engram_fixtures.demo import make_facts
from engram_fixtures.live import REPO_ROOT, LiveServer, free_port, start_server, stop_server
from tests.client.conftest import ReadyVariant
from tests.helpers.s3 import SeaweedServer

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
    assert client.health() == Health(status="ok") and client.health()["status"] == "ok"
    ready = client.ready()
    assert isinstance(ready, Readiness) and (ready.status, ready["mode"], ready.workers) == ("ready", "embedded", None)
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


# ---------------------------------------------------------------- evaluation, generation, maps (the cli2 variant)

SCORES = {"mean_nll", "exact_match", "n"}


def test_evaluate_with_wait_polls_to_the_summary(client: EngramClient, cli2: ReadyVariant) -> None:
    seen: list[Job] = []
    job = client.evaluate(
        cli2.variant_id, forget=cli2.forget, retain=cli2.retain, wait=True, on_progress=seen.append, poll_s=0.1
    )
    assert (job.kind, job.status, job.variant_id) == ("evaluate", "succeeded", cli2.variant_id)
    assert seen[-1] == job == client.get_job(job.job_id)
    summary = job.result["summary"]  # type: ignore[index]
    assert {model: {split: s.model_fields_set for split, s in splits.items()} for model, splits in summary.items()} == {
        model: {"forget": SCORES, "retain": SCORES} for model in ("base", "variant")
    }
    assert summary["variant"]["forget"]["n"] == len(cli2.forget) and summary["base"]["retain"]["n"] == len(cli2.retain)
    records = job.result["records"]  # type: ignore[index]
    assert [(r["split"], r["index"]) for r in records] == [("forget", i) for i in range(len(cli2.forget))] + [
        ("retain", i) for i in range(len(cli2.retain))
    ]


def test_evaluate_sends_pairs_as_probes_and_lets_the_service_wait(client: EngramClient, cli2: ReadyVariant) -> None:
    spy = Recording()
    forget = [(r["prompt"], r["completion"]) for r in cli2.forget[:3]]
    retain = [{**r, "id": n} for n, r in enumerate(cli2.retain[:2])]  # extra keys are dropped
    with EngramClient(client.base_url, transport=spy) as engram:
        job = engram.evaluate(cli2.variant_id, forget, retain, wait_s=30)
    request, status = spy.seen[0]
    assert (request.url.params["wait"], status, job.status) == ("30", 200, "succeeded")  # finished within the hold
    assert json.loads(request.content) == {"forget": cli2.forget[:3], "retain": cli2.retain[:2]}
    assert set(job.result["summary"]["variant"]) == {"forget", "retain"}  # type: ignore[index]
    only_forget = client.evaluate(cli2.variant_id, forget, wait=True, poll_s=0.1)
    assert set(only_forget.result["summary"]["base"]) == {"forget"}  # type: ignore[index]  # no retain probes: absent


def test_evaluate_failures(client: EngramClient, cli2: ReadyVariant) -> None:
    with pytest.raises(ValueError, match=r"retain\[1\]"):
        client.evaluate(cli2.variant_id, retain=[("a", "b"), {"prompt": "no completion"}])
    with pytest.raises(EngramAPIError) as missing:
        client.evaluate("0" * 32, forget=cli2.forget)
    assert (missing.value.status, missing.value.title) == (404, "Not found")
    with pytest.raises(EngramAPIError) as empty:
        client.evaluate(cli2.variant_id)
    assert empty.value.status == 422
    assert empty.value.status == 422


def test_evaluate_with_wait_raises_when_the_job_is_cancelled(client: EngramClient, cli2: ReadyVariant) -> None:
    # Probes of their own (nothing cached) and enough of them that the cancel lands long before the end.
    probes = make_facts(200, seed=5)

    def cancel(job: Job) -> None:
        if job.status not in {"succeeded", "failed", "cancelled"}:
            client.cancel_job(job.job_id)

    with pytest.raises(EngramJobError) as stopped:
        client.evaluate(cli2.variant_id, forget=probes, wait=True, on_progress=cancel, poll_s=0.1)
    assert (stopped.value.job.kind, stopped.value.job.status) == ("evaluate", "cancelled")


def test_generate_both_models_or_one(client: EngramClient, cli2: ReadyVariant) -> None:
    prompt = cli2.forget[0]["prompt"]
    job = client.generate(cli2.variant_id, prompt, max_new_tokens=4, wait=True, poll_s=0.1)
    assert (job.kind, job.status) == ("generate", "succeeded")
    result = job.result or {}
    assert (result["variant_id"], result["prompt"], list(result["outputs"])) == (
        cli2.variant_id,
        prompt,
        ["base", "variant"],
    )
    assert all(isinstance(o["text"], str) and len(o["token_ids"]) <= 4 for o in result["outputs"].values())
    pending = client.generate(cli2.variant_id, prompt, max_new_tokens=4, models=["variant"])
    assert pending.kind == "generate" and pending.status in {"queued", "running", "succeeded"}
    done = client.wait_for_job(pending.job_id, poll_s=0.1)
    assert list(done.result["outputs"]) == ["variant"]  # type: ignore[index]
    assert done.result["outputs"]["variant"] == result["outputs"]["variant"]  # type: ignore[index]  # greedy: the same


def test_finished_jobs_carry_their_kinds_typed_result(
    client: EngramClient, cli2: ReadyVariant, concepts: dict[str, Any], api: httpx.Client
) -> None:
    """An evaluate and a generate job read back as the models of their kinds: the typed result is the
    service's JSON field for field, and it still reads as that JSON object did (``result["summary"]``)."""
    evaluated = client.evaluate(cli2.variant_id, cli2.forget[:2], cli2.retain[:3], wait=True, poll_s=0.1)
    generated = client.generate(cli2.variant_id, cli2.forget[0]["prompt"], max_new_tokens=3, wait=True, poll_s=0.1)
    assert isinstance(evaluated, EvaluateJob) and isinstance(generated, GenerateJob)
    for job, result_model in ((evaluated, EvaluationResult), (generated, GenerationResult)):
        again = client.get_job(job.job_id)
        assert type(again) is type(job) and isinstance(again.result, result_model)
        answered = api.get(f"/jobs/{job.job_id}").json()["result"]
        assert again.result.model_dump(mode="json", exclude_unset=True) == answered
    result = evaluated.result
    assert result is not None
    assert [(r.split, r.index) for r in result.records] == [("forget", 0), ("forget", 1)] + [("retain", i) for i in range(3)]
    forget, retain = result.summary["variant"]["forget"], result.summary["base"]["retain"]
    assert (forget.n, retain.n) == (2, 3)
    assert result["summary"]["variant"]["forget"]["n"] == 2 and result.get("reused") is result.reused
    assert "records" in result and "nothing" not in result and result.get("nothing", 7) == 7
    with pytest.raises(KeyError, match="nothing"):
        result["nothing"]
    assert generated.result is not None and list(generated.result.outputs) == ["base", "variant"]
    assert generated.result["outputs"]["base"]["text"] == generated.result.outputs["base"].text
    collected = client.get_job(concepts["jobs"][0].job_id)  # a kind without a result model: the plain Job
    assert type(collected) is Job and isinstance(collected.result, dict)


def test_a_job_of_another_kind_than_asked_is_an_error(live_server: LiveServer, cli2: ReadyVariant) -> None:
    """The client reads a job by the kind the service names; an answer of another kind is refused, not misread."""

    def generate_as_map(request: httpx.Request) -> httpx.Response:
        url = f"{live_server.base_url}{request.url.path}"
        response = httpx.post(url, json=json.loads(request.read()), timeout=60)
        return httpx.Response(response.status_code, json={**response.json(), "kind": "map"})

    # A spy that rewrites the answer's kind: no real server answers with another kind than it was asked.
    with EngramClient("http://engram.test", transport=httpx.MockTransport(generate_as_map)) as engram:
        with pytest.raises(EngramError, match="expected a GenerateJob, the service answered a map job"):
            engram.generate(cli2.variant_id, cli2.forget[0]["prompt"], max_new_tokens=2)


def test_engram_map_is_the_http_answer(client: EngramClient, cli2: ReadyVariant, api: httpx.Client) -> None:
    data = client.engram_map(cli2.model, ["cli2-forget", "cli2-retain"])
    expected = api.get(f"/models/{cli2.model}/engram-map", params={"concepts": "cli2-forget,cli2-retain"})
    assert isinstance(data, EngramMap) and data.model_dump(mode="json") == expected.json()
    assert data.concepts == data["concepts"] == ["cli2-forget", "cli2-retain"]  # it reads as the dict it was too
    grid = data["maps"]["cli2-forget"]["rho"]
    assert grid == data.maps["cli2-forget"].rho
    assert (len(grid), {len(row) for row in grid}) == (len(data.blocks), {len(data.modules)})
    assert client.engram_map(cli2.model, "cli2-forget", reference=["cli2-retain"])["concepts"] == ["cli2-forget"]
    with pytest.raises(EngramAPIError) as unknown:
        client.engram_map(cli2.model, ["cli2-nothing"])
    assert unknown.value.status == 404 and "cli2-nothing" in unknown.value.detail


def test_engram_map_png_has_the_size_asked(client: EngramClient, cli2: ReadyVariant) -> None:
    png = client.engram_map_png(cli2.model, ["cli2-forget"], width=400, height=300)
    with Image.open(io.BytesIO(png)) as image:
        assert (image.format, image.size) == ("PNG", (400, 300))
    with pytest.raises(EngramAPIError) as tiny:
        client.engram_map_png(cli2.model, ["cli2-forget"], width=10)
    assert tiny.value.status == 422


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
                "engram_client.cli",
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


@pytest.mark.parametrize(
    "post",
    [
        lambda engram: engram.register_model("org/x", "file:///x"),
        lambda engram: engram.evaluate("v1", forget=[("Q", "A")], wait=True),
        lambda engram: engram.generate("v1", "Q", wait_s=5),
    ],
    ids=["models", "evaluate", "generate"],
)
def test_post_is_never_retried(post: Any) -> None:
    calls: list[httpx.Request] = []
    with EngramClient("http://engram.test", transport=scripted([503, 200], calls), backoff_s=0.01) as engram:
        with pytest.raises(EngramAPIError):
            post(engram)
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
