"""A universe built once: its stored factors and engrams against float64 references, a rebuild is a
no-op, and a build cut short redoes only what is missing.

References redo the algebra in float64 with their own eigendecomposition and cut
(``tests.engine.test_compose``). Tolerances: the factors are stored float64 (1e-9 relative, the
reference's own eigh rounding); engrams of a float32 checkpoint are stored float32, so a layer's
engram is the float64 product rounded once (relative error below 1.2e-7, half a float32 ulp per
value: measured ~6e-8); a bfloat16 checkpoint's are stored bfloat16 (half a bfloat16 ulp, 2⁻⁹ =
2e-3 relative per value, below 4e-3 for a layer); a float64 checkpoint's engrams are stored
float64 (1e-10).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from service.engine import compose as compose_module
from service.engine.checkpoint import CheckpointReader
from service.engine.layout import ModelLayout
from service.storage.keys import engram_key, group_key, universe_prefix
from service.universes import factors as factors_module
from service.universes.build import ensure_universe
from service.universes.factors import load_factors
from service.universes.service import submit_universe
from tests.helpers.algebra import reference_engram, reference_pinv, rel
from tests.helpers.store_world import StoreWorld
from tests.helpers.variants import edit_world

FACTOR_TOL = 1e-9
FLOAT32_ENGRAM_TOL = 1.2e-7
BFLOAT16_ENGRAM_TOL = 4e-3
FLOAT64_ENGRAM_TOL = 1e-10


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four models (Llama float32, float64 and bfloat16, GPT-2: Conv1D, biases, tied head), each with
    concepts forget / retain / other published, and each one's universe of the three built."""
    built = edit_world(tmp_path_factory.mktemp("universe-build"), "u", bfloat16=True)
    w: StoreWorld = built["world"]
    universes = {}
    for model_id in built["paths"]:
        view, job = submit_universe(w.ctx, model_id, None, None)
        assert view.status == "building" and job is not None
        [done] = w.run_pending()
        assert done.status == "succeeded", done
        universes[model_id] = view.universe_id
    return {**built, "universes": universes}


def _manifest(world: dict[str, Any], model_id: str) -> dict[str, Any]:
    w: StoreWorld = world["world"]
    return w.ctx.storage.get_json(universe_prefix(world["universes"][model_id]) + "manifest.json")


def _reader(world: dict[str, Any], model_id: str) -> CheckpointReader:
    manifest = world["world"].ctx.storage.get_json(f"models/{model_id.replace('/', '%2F')}.json")
    return CheckpointReader(world["paths"][model_id], ModelLayout.from_json(manifest["layout"]))


@pytest.mark.parametrize("model_id", ["u/llama", "u/gpt2"])
def test_stored_factors_equal_the_float64_pseudo_inverse(world: dict[str, Any], model_id: str) -> None:
    w: StoreWorld = world["world"]
    stats = world["stats"][model_id]
    manifest = _manifest(world, model_id)
    assert set(manifest["groups"]) == set(stats["forget"].layer_group.values())
    for group, info in manifest["groups"].items():
        factors = load_factors(w.ctx.storage.local_path(group_key(manifest["universe_id"], group)))
        total = sum(s.sums[group] for s in stats.values())
        eye = torch.eye(total.shape[0], dtype=torch.float64)
        assert rel(factors.apply_right(eye), reference_pinv(total)) < FACTOR_TOL, group
        assert (info["dim"], info["rank"], info["explicit"]) == (total.shape[0], factors.rank, factors.explicit)


@pytest.mark.parametrize(
    ("model_id", "dtype", "tol"),
    [
        ("u/llama", torch.float32, FLOAT32_ENGRAM_TOL),
        ("u/gpt2", torch.float32, FLOAT32_ENGRAM_TOL),
        ("u/llama64", torch.float64, FLOAT64_ENGRAM_TOL),
        ("u/llama16", torch.bfloat16, BFLOAT16_ENGRAM_TOL),
    ],
)
def test_stored_engrams_equal_the_float64_formula(
    world: dict[str, Any], model_id: str, dtype: torch.dtype, tol: float
) -> None:
    w: StoreWorld = world["world"]
    stats = world["stats"][model_id]
    manifest = _manifest(world, model_id)
    reader = _reader(world, model_id)
    assert len(manifest["layers"]) == len(reader.layout.layers), "every editable layer has an engram"
    keys = {m["names"][0]: m["key"] for m in manifest["members"]}
    worst = 0.0
    for name, member in stats.items():
        path = w.ctx.storage.local_path(engram_key(manifest["universe_id"], keys[name]))
        with safe_open(str(path), framework="pt") as handle:
            for spec in reader.layout.layers:
                stored = handle.get_tensor(spec.name)
                assert stored.dtype == dtype and tuple(stored.shape) == (spec.out_features, spec.stat_dim)
                weights = reader.layer_weights(spec)
                universe = sum(s.sum_for(spec.name) for s in stats.values())
                expected = reference_engram(spec, weights, member.sum_for(spec.name), universe)
                error = rel(stored.double(), expected)
                worst = max(worst, error)
                assert error < tol, (name, spec.name, error)
                norm = manifest["engrams"][keys[name]]["norms"][spec.name]
                assert norm == pytest.approx(float(stored[:, : spec.in_features].double().norm()), rel=1e-12)
    print(f"{model_id}: worst relative engram error of the stored engrams {worst:.2e}")  # noqa: T201


def test_manifest_says_what_was_built(world: dict[str, Any]) -> None:
    manifest = _manifest(world, "u/llama")
    names = sorted(n for m in manifest["members"] for n in m["names"])
    assert names == ["forget", "other", "retain"]
    assert all(m["tokens"] > 0 for m in manifest["members"])
    parts = manifest["bytes"]
    assert parts["total"] == parts["groups"] + parts["engrams"] > 0
    assert parts["engrams"] == sum(e["bytes"] for e in manifest["engrams"].values())
    seconds = manifest["seconds"]
    # Each of the three figures is rounded to 1 ms on its own: the parts' sum may exceed the total
    # by up to 1.5 ms (a fresh-clone CI met 0.052 against 0.020 + 0.033).
    assert seconds["total"] >= seconds["decomposition"] + seconds["engrams"] - 1.5e-3 - 1e-9
    assert {layer["dtype"] for layer in manifest["layers"].values()} == {"F32"}
    # Every group says how it was decomposed and by whom (this process: the job built alone).
    assert {(g["source"], g["worker"].rsplit(":", 1)[1]) for g in manifest["groups"].values()} == {
        ("sums", str(os.getpid()))
    }
    assert {layer["dtype"] for layer in _manifest(world, "u/llama64")["layers"].values()} == {"F64"}
    assert {layer["dtype"] for layer in _manifest(world, "u/llama16")["layers"].values()} == {"BF16"}


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_building_an_existing_universe_again_is_a_noop(world: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    w: StoreWorld = world["world"]
    uid = world["universes"]["u/llama"]
    folder = w.ctx.storage.local_path(universe_prefix(uid) + "manifest.json").parent
    before = _files(folder)
    monkeypatch.setattr(torch.linalg, "eigh", _forbidden("eigh"))
    manifest, existed = ensure_universe(w.ctx, uid)
    assert existed and manifest.universe_id == uid
    assert manifest.to_json() == _manifest(world, "u/llama"), "the record reads back the stored keys and values"
    view, job = submit_universe(w.ctx, "u/llama", None, None)
    assert job is None and view.status == "ready" and view.universe_id == uid
    assert _files(folder) == before


def test_a_build_cut_short_redoes_only_the_missing_parts(world: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed build leaves some groups and members published and no manifest: the next run
    decomposes only the missing group and computes only the missing member's engrams."""
    w: StoreWorld = world["world"]
    manifest = _manifest(world, "u/gpt2")
    uid = manifest["universe_id"]
    storage = w.ctx.storage
    folder = storage.local_path(universe_prefix(uid) + "manifest.json").parent
    before = {k: v[0] for k, v in _files(folder).items()}
    lost_group = next(iter(manifest["groups"]))
    lost_member = manifest["members"][0]["key"]
    for key in (
        universe_prefix(uid) + "manifest.json",
        group_key(uid, lost_group),
        engram_key(uid, lost_member),
        engram_key(uid, lost_member, ".json"),
    ):
        storage.delete(key)
    decompositions: list[int] = []
    engrams: list[str] = []
    real_pinv, real_engram = factors_module.pinv_factors, compose_module.EngramAlgebra.engram
    monkeypatch.setattr(factors_module, "pinv_factors", lambda *a, **k: decompositions.append(1) or real_pinv(*a, **k))
    monkeypatch.setattr(
        compose_module.EngramAlgebra,
        "engram",
        lambda self, spec, weights: engrams.append(spec.name) or real_engram(self, spec, weights),
    )
    rebuilt, existed = ensure_universe(w.ctx, uid)
    assert not existed
    assert len(decompositions) == 1, "only the lost group is decomposed again"
    assert len(engrams) == len(manifest["layers"]), "only the lost member's engrams are computed again"
    sizes = {k: v[0] for k, v in _files(folder).items()}
    assert sizes.keys() == before.keys()
    # Parts and their records, byte for byte the same size (a record of who built a part says how long it took).
    assert {k: v for k, v in sizes.items() if k != "manifest.json" and not k.startswith("parts/")} == {
        k: v for k, v in before.items() if k != "manifest.json" and not k.startswith("parts/")
    }
    assert rebuilt.to_json()["members"] == manifest["members"]
    assert {g: _shape(i) for g, i in rebuilt.to_json()["groups"].items()} == {
        g: _shape(i) for g, i in manifest["groups"].items()
    }


def _shape(group: dict[str, Any]) -> dict[str, Any]:
    """A manifest's group without who built it and how long it took."""
    return {k: v for k, v in group.items() if k not in ("worker", "seconds")}


def _forbidden(what: str) -> Any:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError(f"{what} was called")

    return refuse
