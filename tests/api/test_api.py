"""The HTTP API (docs/API.md), driven through the real server process (``live_server``).

Tests share one server and build on each other's state the way users do: module fixtures register
the tiny model and collect two concepts once; every bad-input test checks that the request changed
nothing (listings and the set of files in storage are the same afterwards).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from engram_fixtures.demo import make_facts
from engram_fixtures.live import (
    MAX_JSON_BYTES,
    LiveServer,
    wait_concepts_ready,
    wait_for_job,
    wait_variant_ready,
)
from tests.helpers.api import PROBLEM_KEYS, assert_problem, jsonl, register_model, unchanged

MODEL = "org/tiny"  # the happy path's model: concepts "forget" and "retain"
MODEL_B = "org/tiny-b"  # same checkpoint, other ID: multipart uploads and cancelled collections
FACTS = make_facts(40, seed=0)


def pairs(facts: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"prompt": p, "completion": c} for p, c in facts]


FORGET = pairs(FACTS[:4])
RETAIN = pairs(FACTS[4:20])
UPLOADED = pairs(FACTS[20:28])


# ---------------------------------------------------------------- helpers


def raw_get(server: LiveServer, path: str) -> tuple[int, str, bytes]:
    """GET a path byte for byte (httpx would normalise '..' segments away)."""
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.getheader("content-type", ""), response.read()
    finally:
        conn.close()


def register(api: httpx.Client, model_id: str, path: Path) -> httpx.Response:
    return api.post("/models", json={"model_id": model_id, "source": f"file://{path}"})


def post_concept(
    api: httpx.Client, name: str, records: list[dict[str, Any]], models: list[str], **extra: Any
) -> httpx.Response:
    return api.post("/concepts", json={"name": name, "models": models, "records": records, **extra})


def download(api: httpx.Client, variant_id: str, path: str, **headers: str) -> httpx.Response:
    return api.get(f"/variants/{variant_id}/files/{path}", headers=headers)


# ---------------------------------------------------------------- shared state


@dataclass
class World:
    server: LiveServer
    api: httpx.Client
    model_root: Path
    model_dir: Path
    concept_posts: dict[str, dict[str, Any]]  # name -> the 202 body of its first POST


@pytest.fixture(scope="module")
def world(live_server: LiveServer, tiny_llama_dir: Path) -> World:
    """``org/tiny`` and ``org/tiny-b`` registered; concepts ``forget`` and ``retain`` ready on ``org/tiny``."""
    api = live_server.client
    for model_id in (MODEL, MODEL_B):
        register_model(api, model_id, f"file://{tiny_llama_dir}", existing_ok=True)
    posts = {}
    for name, records, role in (("forget", FORGET, "target"), ("retain", RETAIN, "reference")):
        response = post_concept(api, name, records, [MODEL], role=role)
        assert response.status_code == 202, response.text
        posts[name] = response.json()
    wait_concepts_ready(api, ["forget", "retain"], MODEL)
    return World(live_server, api, live_server.model_root, tiny_llama_dir, posts)


@pytest.fixture(scope="module")
def unlearned(world: World) -> dict[str, Any]:
    """The ready checkpoint variant that unlearns ``forget`` from ``org/tiny`` (reference: forget+retain)."""
    body = {"concepts": ["forget"], "alpha": 1.0, "reference": ["forget", "retain"]}
    response = world.api.post(f"/models/{MODEL}/unlearn", json=body)
    assert response.status_code in (200, 202), response.text
    variant = wait_variant_ready(world.api, response.json()["variant"]["variant_id"])
    return {"request": body, "first": response, "variant": variant}


# ---------------------------------------------------------------- operations


def test_healthz_readyz_and_openapi(live_server: LiveServer) -> None:
    api = live_server.client
    assert api.get("/healthz").status_code == 200
    ready = api.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["status"] == "ready"
    spec = api.get("/openapi.json")
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    expected = {
        "/models": {"get", "post"},
        "/models/{model_id}": {"get"},
        "/models/{model_id}/unlearn": {"post"},
        "/models/{model_id}/compose": {"post"},
        "/models/{model_id}/variants": {"get"},
        "/concepts": {"get", "post"},
        "/concepts/{name}": {"get", "delete"},
        "/jobs/{job_id}": {"get", "delete"},
        "/variants": {"get"},
        "/variants/{variant_id}": {"get"},
        "/variants/{variant_id}/files/{path}": {"get"},
        "/healthz": {"get"},
        "/readyz": {"get"},
    }
    for path, methods in expected.items():
        assert path in paths, sorted(paths)
        assert methods <= set(paths[path]), (path, sorted(paths[path]))
    concept_body = paths["/concepts"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(concept_body)


# ---------------------------------------------------------------- models


def test_concurrent_identical_registrations_answer_one_201(live_server: LiveServer, tiny_llama_dir: Path) -> None:
    """Eight identical POST /models at once: one registration job, one 201 (the request that started
    it); the others followed it and answer 200, as for a registration that exists."""
    from concurrent.futures import ThreadPoolExecutor

    def post(_: int) -> int:
        with httpx.Client(base_url=live_server.base_url, timeout=60) as client:
            return register(client, "acme/racing", tiny_llama_dir).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = sorted(pool.map(post, range(8)))
    assert codes == [200] * 7 + [201], codes


def test_register_model_created_then_same_then_conflict(live_server: LiveServer, tiny_llama_dir: Path) -> None:
    api = live_server.client
    first = register(api, "acme/first", tiny_llama_dir)
    assert first.status_code == 201, first.text
    model = first.json()
    assert model["model_id"] == "acme/first"
    assert model["source"] == f"file://{tiny_llama_dir}"
    assert model["architecture"] == "LlamaForCausalLM"
    assert model["num_parameters"] > 0
    assert len(model["digest"]) == 64
    names = {layer["name"] for layer in model["layers"]}
    assert "model.layers.0.self_attn.q_proj" in names
    assert "model.layers.1.mlp.down_proj" in names
    q_proj = next(layer for layer in model["layers"] if layer["name"] == "model.layers.0.self_attn.q_proj")
    assert q_proj == {"name": "model.layers.0.self_attn.q_proj", "in_features": 32, "out_features": 32, "bias": False}

    again = register(api, "acme/first", tiny_llama_dir)
    assert again.status_code == 200, again.text
    assert again.json() == model

    with unchanged(live_server):
        conflict = api.post("/models", json={"model_id": "acme/first", "source": f"file://{tiny_llama_dir}/../other"})
        assert_problem(conflict, 409, "acme/first")


def test_list_and_get_models_with_slash_in_id(world: World) -> None:
    listed = world.api.get("/models")
    assert listed.status_code == 200
    ids = {m["model_id"] for m in listed.json()}
    assert {MODEL, MODEL_B} <= ids
    one = world.api.get(f"/models/{MODEL}")
    assert one.status_code == 200, one.text
    assert one.json()["model_id"] == MODEL
    assert one.json() == next(m for m in listed.json() if m["model_id"] == MODEL)
    assert world.api.get("/models/org/tiny-nope").status_code == 404


# ---------------------------------------------------------------- concepts and jobs


def test_concepts_ready_with_token_progress(world: World) -> None:
    for name, records in (("forget", FORGET), ("retain", RETAIN)):
        posted = world.concept_posts[name]
        assert posted["concept"]["name"] == name
        assert posted["concept"]["num_records"] == len(records)
        assert posted["concept"]["models"][MODEL]["status"] in {"pending", "collecting", "ready"}
        [job] = posted["jobs"]
        assert job["kind"] == "collect"
        assert job["progress"]["unit"] == "tokens"

        concept = world.api.get(f"/concepts/{name}").json()
        state = concept["models"][MODEL]
        assert state["status"] == "ready"
        assert state["job_id"] == job["job_id"]
        done = wait_for_job(world.api, job["job_id"])
        assert done["status"] == "succeeded", done
        assert done["progress"]["unit"] == "tokens"
        assert done["progress"]["done"] == done["progress"]["total"] == state["tokens"] > 0
        assert done["error"] is None
        assert done["started_at"]
        assert done["finished_at"]
        assert done["created_at"]
    assert world.api.get("/concepts/retain").json()["role"] == "reference"
    assert {"forget", "retain"} <= {c["name"] for c in world.api.get("/concepts").json()}


def test_posting_the_same_concept_again_is_idempotent(world: World) -> None:
    job_id = world.concept_posts["forget"]["jobs"][0]["job_id"]
    jobs_before = sorted((world.server.storage_dir / "jobs").glob("*.json"))
    again = post_concept(world.api, "forget", FORGET, [MODEL])
    assert again.status_code in (200, 202), again.text
    assert [j["job_id"] for j in again.json()["jobs"]] == [job_id]
    assert again.json()["concept"]["models"][MODEL]["status"] == "ready"
    assert sorted((world.server.storage_dir / "jobs").glob("*.json")) == jobs_before

    # Listing a further model starts a collection for that model only.
    more = post_concept(world.api, "forget", FORGET, [MODEL, MODEL_B])
    assert more.status_code in (200, 202), more.text
    jobs = {j["job_id"] for j in more.json()["jobs"]}
    assert job_id in jobs
    assert len(jobs) == 2
    assert len(list((world.server.storage_dir / "jobs").glob("*.json"))) == len(jobs_before) + 1
    wait_concepts_ready(world.api, ["forget"])


# ---------------------------------------------------------------- variants


def test_unlearn_builds_a_variant_and_repeating_it_returns_the_same(world: World, unlearned: dict[str, Any]) -> None:
    first = unlearned["first"]
    assert first.status_code == 202, first.text
    submitted = first.json()
    assert submitted["variant"]["status"] == "building"
    assert submitted["job"]["kind"] == "variant"
    assert submitted["job"]["progress"]["unit"] == "layers"
    variant = unlearned["variant"]
    assert variant["variant_id"] == submitted["variant"]["variant_id"]
    assert variant["model_id"] == MODEL
    assert variant["terms"] == {"forget": -1.0}
    assert variant["alpha"] == 1.0
    assert variant["scaling"] == "uniform"
    assert variant["format"] == "checkpoint"
    paths = {f["path"] for f in variant["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= paths
    job = wait_for_job(world.api, submitted["job"]["job_id"])
    assert job["status"] == "succeeded"
    assert job["progress"]["done"] == job["progress"]["total"] > 0

    repeat = world.api.post(f"/models/{MODEL}/unlearn", json=unlearned["request"])
    assert repeat.status_code == 200, repeat.text
    assert repeat.json()["variant"]["variant_id"] == variant["variant_id"]
    assert repeat.json()["variant"]["status"] == "ready"


def test_download_checks_sha256_and_range(world: World, unlearned: dict[str, Any], tmp_path: Path) -> None:
    variant = unlearned["variant"]
    vid = variant["variant_id"]
    entries = {f["path"]: f for f in variant["files"]}
    for path in entries:
        response = download(world.api, vid, path)
        assert response.status_code == 200, response.text
        assert len(response.content) == entries[path]["size"]
        assert hashlib.sha256(response.content).hexdigest() == entries[path]["sha256"]
        (tmp_path / path).write_bytes(response.content)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    full = (tmp_path / "model.safetensors").read_bytes()
    part = download(world.api, vid, "model.safetensors", Range="bytes=100-1123")
    assert part.status_code == 206, part.text
    assert part.content == full[100:1124]
    assert part.headers["content-range"] == f"bytes 100-1123/{len(full)}"
    suffix = download(world.api, vid, "model.safetensors", Range="bytes=-16")
    assert suffix.status_code == 206
    assert suffix.content == full[-16:]
    assert_problem(download(world.api, vid, "model.safetensors", Range=f"bytes={len(full)}-"), 416)

    # The checkpoint loads, and the edit changed the weights of the edited layers only.
    from transformers import AutoModelForCausalLM

    edited = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    base = AutoModelForCausalLM.from_pretrained(world.model_dir).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(edited[key], base[key])
    assert torch.equal(edited["model.norm.weight"], base["model.norm.weight"])


def test_delta_format_holds_only_changed_tensors(world: World, unlearned: dict[str, Any]) -> None:
    body = {**unlearned["request"], "format": "delta", "modules": ["q_proj", "down_proj"]}
    response = world.api.post(f"/models/{MODEL}/unlearn", json=body)
    assert response.status_code == 202, response.text
    variant = wait_variant_ready(world.api, response.json()["variant"]["variant_id"])
    assert variant["variant_id"] != unlearned["variant"]["variant_id"]
    assert variant["format"] == "delta"
    assert variant["modules"] == ["q_proj", "down_proj"]
    [entry] = variant["files"]
    assert entry["path"] == "delta.safetensors"
    data = download(world.api, variant["variant_id"], "delta.safetensors")
    assert data.status_code == 200
    assert hashlib.sha256(data.content).hexdigest() == entry["sha256"]
    tensors = load_safetensors(data.content)
    assert sorted(tensors) == sorted(
        f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")
    )


def test_compose_with_a_positive_coefficient(world: World) -> None:
    response = world.api.post(f"/models/{MODEL}/compose", json={"terms": {"forget": 0.5}, "scaling": "weight_norm"})
    assert response.status_code == 202, response.text
    variant = wait_variant_ready(world.api, response.json()["variant"]["variant_id"])
    assert variant["terms"] == {"forget": 0.5}
    assert variant["alpha"] is None
    assert variant["scaling"] == "weight_norm"
    assert {"config.json", "model.safetensors"} <= {f["path"] for f in variant["files"]}


def test_list_variants_of_a_model(world: World, unlearned: dict[str, Any]) -> None:
    listed = world.api.get(f"/models/{MODEL}/variants")
    assert listed.status_code == 200, listed.text
    variants = listed.json()
    assert unlearned["variant"]["variant_id"] in {v["variant_id"] for v in variants}
    assert all(v["model_id"] == MODEL for v in variants)
    assert world.api.get(f"/models/{MODEL_B}/variants").json() == []
    assert_problem(world.api.get("/models/org/nope/variants"), 404)
    everything = world.api.get("/variants").json()
    assert unlearned["variant"]["variant_id"] in {v["variant_id"] for v in everything}
    filtered = world.api.get("/variants", params={"model_id": MODEL}).json()
    assert filtered == variants
    assert_problem(world.api.get("/variants", params={"model_id": "org/nope"}), 404)


# ---------------------------------------------------------------- multipart upload


def test_multipart_upload_is_collected_and_idempotent(world: World) -> None:
    api = world.api
    form = {"name": "uploaded", "models": MODEL_B, "role": "target", "description": "multipart"}
    response = api.post("/concepts", data=form, files={"dataset": ("facts.jsonl", jsonl(UPLOADED), "application/x-ndjson")})
    assert response.status_code == 202, response.text
    submitted = response.json()
    [job] = submitted["jobs"]
    assert submitted["concept"]["num_records"] == len(UPLOADED)
    assert job["progress"]["unit"] == "tokens"
    wait_concepts_ready(api, ["uploaded"], MODEL_B)
    assert wait_for_job(api, job["job_id"])["status"] == "succeeded"

    jobs_before = sorted((world.server.storage_dir / "jobs").glob("*.json"))
    again = api.post("/concepts", data=form, files={"dataset": ("facts.jsonl", jsonl(UPLOADED), "application/x-ndjson")})
    assert again.status_code in (200, 202), again.text
    assert [j["job_id"] for j in again.json()["jobs"]] == [job["job_id"]]
    as_json = post_concept(api, "uploaded", UPLOADED, [MODEL_B], role="target", description="multipart")
    assert as_json.status_code in (200, 202), as_json.text
    assert [j["job_id"] for j in as_json.json()["jobs"]] == [job["job_id"]]
    assert sorted((world.server.storage_dir / "jobs").glob("*.json")) == jobs_before

    with unchanged(world.server):
        other = jsonl(UPLOADED[:-1])
        conflict = api.post("/concepts", data=form, files={"dataset": ("facts.jsonl", other, "application/x-ndjson")})
        assert_problem(conflict, 409, "uploaded")


def test_multipart_malformed_jsonl_line_is_400(world: World) -> None:
    data = jsonl(UPLOADED[:2]) + b'{"prompt": "broken\n'
    with unchanged(world.server):
        response = world.api.post(
            "/concepts",
            data={"name": "broken-upload", "models": MODEL_B},
            files={"dataset": ("broken.jsonl", data, "application/x-ndjson")},
        )
        assert_problem(response, 400, "line 3")


# ---------------------------------------------------------------- bad input changes nothing


Request = Callable[[World, dict[str, Any]], httpx.Response]


def _post(path: str, body: Any) -> Request:
    return lambda world, _: world.api.post(path, json=body)


def _post_raw(path: str, content: bytes) -> Request:
    return lambda world, _: world.api.post(path, content=content, headers={"content-type": "application/json"})


BAD_REQUESTS: list[tuple[str, Request, int, tuple[str, ...]]] = [
    (
        "concept-unknown-model",
        _post("/concepts", {"name": "x1", "models": ["org/missing"], "records": FORGET}),
        404,
        ("org/missing",),
    ),
    ("concept-empty-records", _post("/concepts", {"name": "x2", "models": [MODEL], "records": []}), 422, ("records",)),
    (
        "concept-text-and-prompt",
        _post("/concepts", {"name": "x3", "models": [MODEL], "records": [{"text": "a", "prompt": "b", "completion": "c"}]}),
        422,
        ("record 0",),
    ),
    ("concept-bad-name", _post("/concepts", {"name": "../evil", "models": [MODEL], "records": FORGET}), 422, ("name",)),
    ("concept-malformed-json", _post_raw("/concepts", b'{"name": "x4", "models": ['), 400, ()),
    ("unlearn-malformed-json", _post_raw(f"/models/{MODEL}/unlearn", b'{"concepts": '), 400, ()),
    (
        "unlearn-unknown-concept",
        _post(f"/models/{MODEL}/unlearn", {"concepts": ["no-such-concept"]}),
        404,
        ("no-such-concept",),
    ),
    ("unlearn-unknown-model", _post("/models/org/missing/unlearn", {"concepts": ["forget"]}), 404, ("org/missing",)),
    (
        "unlearn-unknown-module",
        _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "modules": ["warp_proj"]}),
        422,
        ("warp_proj",),
    ),
    ("unlearn-layer-out-of-range", _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "layers": [7]}), 422, ()),
    ("unlearn-alpha-zero", _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "alpha": 0}), 422, ("alpha",)),
    ("unlearn-alpha-negative", _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "alpha": -1.0}), 422, ("alpha",)),
    ("unlearn-alpha-huge", _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "alpha": 1000}), 422, ("alpha",)),
    ("unlearn-alpha-text", _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "alpha": "lots"}), 422, ("alpha",)),
    ("unlearn-alpha-nan", _post_raw(f"/models/{MODEL}/unlearn", b'{"concepts": ["forget"], "alpha": NaN}'), 422, ()),
    (
        "unlearn-bad-scaling",
        _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "scaling": "cubic"}),
        422,
        ("scaling",),
    ),
    ("unlearn-bad-rcond", _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "rcond": 2.0}), 422, ("rcond",)),
    (
        "unlearn-lora-rank-with-checkpoint",
        _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "format": "checkpoint", "lora_rank": 8}),
        422,
        ("lora_rank", "peft"),
    ),
    (
        "compose-lora-rank-with-delta",
        _post(f"/models/{MODEL}/compose", {"terms": {"forget": 1.0}, "format": "delta", "lora_rank": 8}),
        422,
        ("lora_rank",),
    ),
    (
        "unlearn-lora-rank-zero",
        _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "format": "peft", "lora_rank": 0}),
        422,
        ("lora_rank",),
    ),
    ("unlearn-unknown-field", _post(f"/models/{MODEL}/unlearn", {"concepts": ["forget"], "beta": 1}), 422, ("beta",)),
    ("compose-zero-coefficient", _post(f"/models/{MODEL}/compose", {"terms": {"forget": 0}}), 422, ()),
    ("compose-infinite-coefficient", _post_raw(f"/models/{MODEL}/compose", b'{"terms": {"forget": Infinity}}'), 422, ()),
    ("compose-unknown-concept", _post(f"/models/{MODEL}/compose", {"terms": {"ghost": 1.0}}), 404, ("ghost",)),
    ("model-bad-id", _post("/models", {"model_id": "a/b/c", "source": "file:///x"}), 422, ("model_id",)),
    ("model-bad-scheme", _post("/models", {"model_id": "bad/scheme", "source": "ftp://x/y"}), 422, ()),
    ("model-outside-roots", lambda w, d: register(w.api, "bad/outside", d["outside"]), 422, ("ENGRAM_MODEL_ROOTS",)),
    (
        "model-dotdot",
        lambda w, d: w.api.post(
            "/models", json={"model_id": "bad/dotdot", "source": f"file://{w.model_root}/../outside-model"}
        ),
        422,
        ("..",),
    ),
    ("model-symlink-out", lambda w, d: register(w.api, "bad/symlink", d["symlink"]), 422, ("ENGRAM_MODEL_ROOTS",)),
    ("model-bad-hf-source", _post("/models", {"model_id": "bad/hf", "source": "hf://../../etc"}), 422, ("hf://",)),
    ("model-relative-path", _post("/models", {"model_id": "bad/relative", "source": "file://models/tiny"}), 422, ()),
    ("model-missing-dir", lambda w, d: register(w.api, "bad/missing", w.model_root / "nothing-here"), 422, ()),
    ("model-pickle-weights", lambda w, d: register(w.api, "bad/pickle", d["pickle"]), 422, ("pytorch_model.bin",)),
    ("model-remote-code", lambda w, d: register(w.api, "bad/remote", d["remote"]), 422, ("auto_map",)),
    ("model-no-config", lambda w, d: register(w.api, "bad/noconfig", d["noconfig"]), 422, ("config.json",)),
    ("job-unknown", lambda w, d: w.api.get("/jobs/0123456789abcdef0123456789abcdef"), 404, ()),
    ("job-delete-unknown", lambda w, d: w.api.delete("/jobs/0123456789abcdef0123456789abcdef"), 404, ()),
    ("variant-unknown", lambda w, d: w.api.get("/variants/0123456789abcdef0123456789abcdef"), 404, ()),
    ("variant-file-unknown-variant", lambda w, d: w.api.get("/variants/0123456789abcdef/files/config.json"), 404, ()),
    ("variant-file-missing", lambda w, d: w.api.get(f"/variants/{d['variant_id']}/files/nope.bin"), 404, ()),
    ("concept-unknown", lambda w, d: w.api.get("/concepts/no-such-concept"), 404, ()),
    ("concept-delete-unknown", lambda w, d: w.api.delete("/concepts/no-such-concept"), 404, ()),
    ("model-unknown", lambda w, d: w.api.get("/models/org/missing"), 404, ()),
]


@pytest.fixture(scope="module")
def bad_inputs(world: World, unlearned: dict[str, Any], engram_root: Path) -> dict[str, Any]:
    """Model directories the server must refuse, and a ready variant to attack through file paths."""
    root, source = world.model_root, world.model_dir
    outside = engram_root / "outside-model"  # a valid checkpoint, but not under ENGRAM_MODEL_ROOTS
    if not outside.exists():
        shutil.copytree(source, outside)
    symlink = root / "link-out"
    if not symlink.exists():
        symlink.symlink_to(outside, target_is_directory=True)
    pickle_dir = root / "pickled"
    if not pickle_dir.exists():
        pickle_dir.mkdir()
        shutil.copyfile(source / "config.json", pickle_dir / "config.json")
        torch.save({"model.norm.weight": torch.ones(32)}, pickle_dir / "pytorch_model.bin")
    remote = root / "remote-code"
    if not remote.exists():
        shutil.copytree(source, remote)
        config = json.loads((remote / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
        (remote / "config.json").write_text(json.dumps(config))
        (remote / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    noconfig = root / "no-config"
    if not noconfig.exists():
        noconfig.mkdir()
        save_file({"w": torch.zeros(2, 2)}, str(noconfig / "model.safetensors"))
    return {
        "outside": outside,
        "symlink": symlink,
        "pickle": pickle_dir,
        "remote": remote,
        "noconfig": noconfig,
        "variant_id": unlearned["variant"]["variant_id"],
    }


@pytest.mark.parametrize(
    ("request_of", "status", "mentions"),
    [pytest.param(r, s, m, id=case) for case, r, s, m in BAD_REQUESTS],
)
def test_bad_input_is_a_problem_and_changes_nothing(
    world: World, bad_inputs: dict[str, Any], request_of: Request, status: int, mentions: tuple[str, ...]
) -> None:
    with unchanged(world.server):
        assert_problem(request_of(world, bad_inputs), status, *mentions)


def test_oversized_json_body_is_413(world: World) -> None:
    padding = "x" * (2 * MAX_JSON_BYTES)
    body = json.dumps({"name": "too-big", "models": [MODEL], "records": [{"text": padding}]}).encode()
    with unchanged(world.server):
        response = world.api.post("/concepts", content=body, headers={"content-type": "application/json"})
        assert_problem(response, 413)


def test_oversized_chunked_body_is_413(world: World) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"name": "too-big", "models": ["org/tiny"], "records": [{"text": "'
        for _ in range(2 * MAX_JSON_BYTES // 65536 + 1):
            yield b"x" * 65536
        yield b'"}]}'

    with unchanged(world.server):
        response = world.api.post("/concepts", content=chunks(), headers={"content-type": "application/json"})
        assert_problem(response, 413)


@pytest.mark.parametrize(
    "path",
    [
        "/variants/{vid}/files/../config.json",
        "/variants/{vid}/files/..%2F..%2Fmodels%2Forg%252Ftiny.json",
        "/variants/{vid}/files/..%2F..%2F..%2Fjobs",
        "/variants/{vid}/files/%2e%2e/request.json",
        "/variants/{vid}/files/%2Fetc%2Fpasswd",
        "/variants/..%2F..%2Fmodels/files/org%252Ftiny.json",
        "/variants/{vid}/files/./config.json",
    ],
)
def test_file_paths_cannot_escape_the_variant(world: World, bad_inputs: dict[str, Any], path: str) -> None:
    with unchanged(world.server):
        status, content_type, body = raw_get(world.server, path.format(vid=bad_inputs["variant_id"]))
        assert status == 404, body
        assert content_type.startswith("application/problem+json")
        assert json.loads(body).keys() >= PROBLEM_KEYS


# Hostile IDs must never reach the filesystem as-is. A fresh connection per request, so a regression
# (a 500, after which the server drops the keep-alive connection) fails only its own case.
LONG = "a" * 5000
KNOWN_500S = [
    ("job-id-too-long", "GET", f"/jobs/{LONG}", None, 404),
    ("concept-name-too-long", "GET", f"/concepts/{LONG}", None, 404),
    ("model-id-too-long", "GET", f"/models/{LONG}", None, 404),
    ("variant-id-too-long", "GET", f"/variants/{LONG}", None, 404),
    ("model-source-with-nul", "POST", "/models", {"model_id": "bad/nul", "source": "file:///models/tiny\u0000"}, 422),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), [pytest.param(*case[1:], id=case[0]) for case in KNOWN_500S])
def test_hostile_ids_are_4xx_not_500(world: World, method: str, path: str, body: Any, status: int) -> None:
    with unchanged(world.server), httpx.Client(base_url=world.server.base_url, timeout=30) as fresh:
        assert_problem(fresh.request(method, path, json=body), status)


# ---------------------------------------------------------------- cancellation and readiness


@pytest.fixture(scope="module")
def cancelled(world: World) -> dict[str, Any]:
    """A collection cancelled while queued: a long collection on ``org/tiny-b`` holds the one collect
    lane, so the second concept's job waits behind it until we cancel it; then the long one is
    cancelled too. Both concepts are then deterministically not ready on ``org/tiny-b``."""
    api = world.api
    facts = [p + c for p, c in make_facts(40, seed=7)]
    long_records = [{"text": " ".join(facts[(i + k) % len(facts)] for k in range(4))} for i in range(512)]
    blocker = post_concept(api, "blocker", long_records, [MODEL_B])
    assert blocker.status_code == 202, blocker.text
    queued = post_concept(api, "queued", [{"text": f} for f in facts[:6]], [MODEL_B])
    assert queued.status_code == 202, queued.text
    [queued_job] = queued.json()["jobs"]
    cancel = api.delete(f"/jobs/{queued_job['job_id']}")
    [blocker_job] = blocker.json()["jobs"]
    api.delete(f"/jobs/{blocker_job['job_id']}")
    return {
        "queued_job": queued_job,
        "cancel": cancel,
        "queued_final": wait_for_job(api, queued_job["job_id"]),
        "blocker_final": wait_for_job(api, blocker_job["job_id"]),
    }


def test_delete_job_cancels_a_queued_job(world: World, cancelled: dict[str, Any]) -> None:
    assert cancelled["queued_job"]["status"] == "queued"
    cancel = cancelled["cancel"]
    assert cancel.status_code == 200, cancel.text
    assert cancel.json()["status"] == "cancelled"
    assert cancelled["queued_final"]["status"] == "cancelled"
    assert cancelled["queued_final"]["finished_at"]
    assert cancelled["blocker_final"]["status"] == "cancelled"
    state = world.api.get("/concepts/queued").json()["models"][MODEL_B]
    assert state["status"] != "ready"
    assert state["tokens"] is None
    # Cancelling a finished job changes nothing.
    again = world.api.delete(f"/jobs/{cancelled['queued_job']['job_id']}")
    assert again.status_code == 200
    assert again.json()["status"] == "cancelled"


def test_unlearning_a_not_ready_concept_is_409(world: World, cancelled: dict[str, Any]) -> None:
    with unchanged(world.server):
        response = world.api.post(f"/models/{MODEL_B}/unlearn", json={"concepts": ["queued"]})
        assert_problem(response, 409, "queued")
    with unchanged(world.server):
        response = world.api.post(f"/models/{MODEL}/unlearn", json={"concepts": ["forget"], "reference": ["queued"]})
        assert_problem(response, 409, "queued")


def test_delete_concept(world: World) -> None:
    response = post_concept(world.api, "short-lived", FORGET, [MODEL_B])
    assert response.status_code == 202, response.text
    wait_concepts_ready(world.api, ["short-lived"], MODEL_B)
    # the concept reads ready once its statistics are published, a moment before its collect job's record
    # is finished; a delete in that moment is a 409 naming the running job
    for job in response.json()["jobs"]:
        assert wait_for_job(world.api, job["job_id"])["status"] == "succeeded"
    deleted = world.api.delete("/concepts/short-lived")
    assert deleted.status_code == 204, deleted.text
    assert deleted.content == b""
    assert_problem(world.api.get("/concepts/short-lived"), 404, "short-lived")
    assert "short-lived" not in {c["name"] for c in world.api.get("/concepts").json()}
    assert_problem(world.api.delete("/concepts/short-lived"), 404)
