"""GET /models/{id}/engram-map(.png) through the live server, against a float64 reference.

A map is computed by a ``map`` job in the job process (it loads weights and decomposes ``Σ_U``):
the API answers 200 with the stored map, or 202 with the job when it is still computed after
``?wait=`` seconds, and a failed job's problem.

The reference recomputes the engram ``E = W Σ_k Σ_U⁺`` from the statistics files in the server's
storage with ``torch.linalg.pinv`` (float64, cut ``D·eps32`` relative to the largest eigenvalue, like
the service's default), independently of the service's factor code, and both measures from it:
``‖E‖_F / ‖W‖_F`` (``measure=weight``) and ``sqrt(tr(E Σ_U Eᵀ) / tr(W Σ_U Wᵀ))`` (the default, ``data``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job
from service.engine.stats_io import load_statistics
from tests.helpers.api import assert_problem, register_model
from tests.helpers.job_process import job_process, paused

MODEL = "map/tiny"
FACTS = make_facts(36, seed=5)
CONCEPTS = {
    "map-a": ("target", FACTS[:4]),
    "map-b": ("target", FACTS[4:8]),
    "map-ref": ("reference", FACTS[8:36]),
}


@pytest.fixture(scope="module")
def ready(api: httpx.Client, tiny_llama_dir: Path) -> None:
    register_model(api, MODEL, f"file://{tiny_llama_dir}", existing_ok=True)
    for name, (role, facts) in CONCEPTS.items():
        records = [{"prompt": p, "completion": c} for p, c in facts]
        response = api.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": records})
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, list(CONCEPTS), MODEL)


def _reference_rho(storage: Path, model_dir: Path, concept: str, measure: str = "weight") -> dict[str, float]:
    """layer -> the measure of ``concept``'s engram against the universe of every concept, in float64."""

    def stats(name: str) -> Any:
        prefix = json.loads((storage / "concepts" / f"{name}.json").read_text())["models"][MODEL]["stats"]
        return load_statistics(storage / prefix / "statistics.safetensors")

    term, universe = stats(concept), [stats(n) for n in CONCEPTS]
    weights = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            weights[key] = handle.get_tensor(key).double()
    rho = {}
    for layer, group in term.layer_group.items():
        key = f"{layer}.weight" if f"{layer}.weight" in weights else "model.embed_tokens.weight"  # tied lm_head
        w = weights[key]
        total = sum(u.sums[u.layer_group[layer]] for u in universe)
        cut = total.shape[0] * torch.finfo(torch.float32).eps
        engram = w @ term.sums[group] @ torch.linalg.pinv(total, rtol=cut, hermitian=True)
        if measure == "weight":
            rho[layer] = float(engram.norm() / w.norm())
        else:  # the tiny Llama's layers have no bias: the plain input covariance
            rho[layer] = float(torch.sqrt(torch.trace(engram @ total @ engram.T) / torch.trace(w @ total @ w.T)))
    return rho


@pytest.mark.parametrize("measure", ["data", "weight"])
def test_map_json_equals_the_float64_reference(
    api: httpx.Client, ready: None, live_server: LiveServer, tiny_llama_dir: Path, measure: str
) -> None:
    params = {"concepts": "map-a,map-b"} | ({} if measure == "data" else {"measure": measure})
    response = api.get(f"/models/{MODEL}/engram-map", params=params)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["concepts"] == ["map-a", "map-b"] and data["reference"] == ["map-ref"]
    assert data["measure"] == measure
    assert data["blocks"] == [0, 1]
    assert data["modules"][:3] == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    assert "mlp.down_proj" in data["modules"]
    assert list(data["outside_blocks"]["map-a"]) == ["lm_head"]  # the head is mapped too
    for concept in ("map-a", "map-b"):
        reference = _reference_rho(live_server.storage_dir, tiny_llama_dir, concept, measure)
        grid = data["maps"][concept]["rho"]
        for layer in data["layers"]:
            if layer["block"] is None:
                served = data["outside_blocks"][concept][layer["name"]]
            else:
                served = grid[data["blocks"].index(layer["block"])][data["modules"].index(layer["module"])]
            assert served == pytest.approx(reference[layer["name"]], rel=1e-6), (concept, layer)
        assert data["maps"][concept]["max"] == pytest.approx(max(reference.values()), rel=1e-6)
        if measure == "data":  # a share of the layer's output on the universe's data
            assert all(0.0 <= value <= 1.0 + 1e-9 for value in reference.values())
    assert data["maps"]["map-a"]["rho"] != data["maps"]["map-b"]["rho"]  # two memories, two maps
    again = api.get(f"/models/{MODEL}/engram-map", params=[("concepts", "map-a"), ("concepts", "map-b"), *(
        [("measure", measure)] if measure != "data" else [])])  # fmt: skip
    assert again.json() == data  # repeated query parameters work too; the second answer is the cached map


def test_the_data_weighted_map_tells_a_small_concept_from_the_reference(api: httpx.Client, ready: None) -> None:
    """The reference holds 28 of 36 facts, map-a 4: weighted by the universe's data, map-a's engram
    accounts for a smaller share of every layer's output than the reference's does."""
    data = api.get(f"/models/{MODEL}/engram-map", params={"concepts": "map-a,map-ref"}).json()
    small, large = data["maps"]["map-a"]["rho"], data["maps"]["map-ref"]["rho"]
    pairs = [(a, b) for row_a, row_b in zip(small, large, strict=True) for a, b in zip(row_a, row_b, strict=True)]
    assert all(a < b for a, b in pairs if a is not None)
    assert data["outside_blocks"]["map-a"]["lm_head"] < data["outside_blocks"]["map-ref"]["lm_head"]


@pytest.mark.parametrize("size", [None, (640, 300)])
def test_map_png_renders_at_the_right_size(api: httpx.Client, ready: None, size: tuple[int, int] | None) -> None:
    params: dict[str, Any] = {"concepts": "map-a,map-b"}
    if size is not None:
        params.update(width=size[0], height=size[1])
    response = api.get(f"/models/{MODEL}/engram-map.png", params=params)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(response.content))
    image.load()
    assert image.format == "PNG"
    assert image.size == (size or (120 + 420 * 2, 220 + 24 * 3))  # two blocks and the head's row
    pixels = torch.tensor(list(image.convert("RGB").getdata()), dtype=torch.float32)
    assert pixels.std() > 20, "the image is (nearly) one flat colour"
    assert len({tuple(p) for p in pixels.tolist()}) > 50, "too few colours for two heatmaps with labels"


@pytest.mark.parametrize(
    ("params", "status", "mention"),
    [
        ({}, 422, "concepts"),
        ({"concepts": ""}, 422, "concept"),
        ({"concepts": "map-a,nope"}, 404, "nope"),
        ({"concepts": ",".join(f"c{i}" for i in range(9))}, 422, "at most"),
        ({"concepts": "map-a", "rcond": 2}, 422, "rcond"),
        ({"concepts": "map-a", "reference": "nope"}, 404, "nope"),
        ({"concepts": "map-a", "measure": "volume"}, 422, "measure"),
    ],
)
def test_bad_map_requests_are_problems(
    api: httpx.Client, ready: None, params: dict[str, Any], status: int, mention: str
) -> None:
    assert_problem(api.get(f"/models/{MODEL}/engram-map", params=params), status, mention)


def test_map_png_size_limits_and_unknown_model(api: httpx.Client, ready: None) -> None:
    assert_problem(api.get(f"/models/{MODEL}/engram-map.png", params={"concepts": "map-a", "width": 10}), 422)
    assert_problem(api.get("/models/map/none/engram-map", params={"concepts": "map-a"}), 404, "map/none")


def test_concept_not_ready_on_the_model_is_409(api: httpx.Client, ready: None, tiny_llama_dir: Path) -> None:
    other = "map/other"
    register_model(api, other, f"file://{tiny_llama_dir}", existing_ok=True)
    assert_problem(api.get(f"/models/{other}/engram-map", params={"concepts": "map-a"}), 409, "map-a")


def test_a_map_not_stored_is_computed_by_one_job_and_then_served_from_storage(
    api: httpx.Client, ready: None, live_server: LiveServer
) -> None:
    url = f"/models/{MODEL}/engram-map"
    params = {"concepts": "map-b,map-a", "rcond": "3e-6"}  # a cut no other test asks for: not stored yet
    with paused(job_process(live_server)):  # the job stays queued while the same request comes again
        first = api.get(url, params={**params, "wait": "0"})
        assert first.status_code == 202, first.text
        job = first.json()
        assert job["kind"] == "map" and job["model_id"] == MODEL and job["status"] == "queued"
        assert first.headers["location"] == f"/jobs/{job['job_id']}"
        again = api.get(url, params={**params, "wait": "0"})
        assert again.status_code == 202 and again.json()["job_id"] == job["job_id"]  # one job, followed
    done = wait_for_job(api, job["job_id"], timeout=120)
    assert done["status"] == "succeeded", done
    assert done["result"]["concepts"] == ["map-b", "map-a"] and done["result"]["reused"] is False
    stored = api.get(url, params={**params, "wait": "0"})
    assert stored.status_code == 200, stored.text
    assert stored.json()["concepts"] == ["map-b", "map-a"] and stored.json()["rcond"] == 3e-6
    png = api.get(f"/models/{MODEL}/engram-map.png", params={**params, "wait": "0"})
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG")  # drawn from the stored map, no job


def test_a_failed_map_job_is_answered_with_its_problem(api: httpx.Client, ready: None, tiny_llama_dir: Path) -> None:
    """A checkpoint changed since registration: the job refuses to read it, and the map request says so."""
    copy = tiny_llama_dir.parent / "tiny-llama-map-copy"
    shutil.copytree(tiny_llama_dir, copy, dirs_exist_ok=True)
    model = "map/changed"
    register_model(api, model, f"file://{copy}", existing_ok=True)
    records = [{"prompt": p, "completion": c} for p, c in FACTS[:4]]
    response = api.post("/concepts", json={"name": "map-changed", "role": "target", "models": [model], "records": records})
    assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["map-changed"], model)
    weights = copy / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    failed = api.get(f"/models/{model}/engram-map", params={"concepts": "map-changed", "wait": "30"})
    assert_problem(failed, 422, "changed since registration")
    job = api.get(f"/jobs/{failed.json()['job_id']}").json()
    assert job["kind"] == "map" and job["status"] == "failed"


def test_a_map_draws_the_layers_every_concept_covers_and_names_the_others(api: httpx.Client, tiny_llama_dir: Path) -> None:
    """A reference collected with ``modules`` covers only those layers: ``Σ_U`` exists there alone,
    so the map draws them and names every layer it leaves off (it was a failed job naming a layer)."""
    model = "map/limited"
    register_model(api, model, f"file://{tiny_llama_dir}", existing_ok=True)
    records = [{"prompt": p, "completion": c} for p, c in FACTS[:8]]
    posts = [
        {"name": "lim-a", "role": "target", "models": [model], "records": records[:4]},
        {"name": "lim-q", "role": "reference", "models": [model], "records": records[4:], "modules": ["q_proj"]},
    ]
    for body in posts:
        assert api.post("/concepts", json=body).status_code == 202
    wait_concepts_ready(api, ["lim-a", "lim-q"], model)
    response = api.get(f"/models/{model}/engram-map", params={"concepts": "lim-a", "reference": "lim-q", "wait": 60})
    assert response.status_code == 200, response.text
    data = response.json()
    drawn = [layer["name"] for layer in data["layers"]]
    assert drawn == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    left = data["left_out"]
    assert left["unreached"] == [] and "lm_head" in left["without_statistics"]
    assert "model.layers.0.mlp.down_proj" in left["without_statistics"] and not set(drawn) & set(left["without_statistics"])
