"""A universe of few tokens: groups whose members all kept rows and together hold fewer tokens than
the group is wide are decomposed from the rows (``T²·D``), the others from the sums (``D³``).

A tiny Llama (hidden 64, MLP 128) and two concepts of one record each (~40 tokens apiece, so every
group is stored as rows): ``Σ T ≈ 75`` is below the MLP's 128-wide ``down_proj`` input and above the
64-wide others. References are float64 from the rows themselves (``X`` are float32 activations,
exact in float64): ``Σ = XᵀX``. Tolerances: factors 1e-9 relative (two float64 solves of the same
matrix, ``eps64·κ``); float32-stored engrams 1.2e-7 on rows groups (half a float32 ulp: ``Σ_k`` and
``Σ_U`` are both the exact ``XᵀX``; measured 2.5e-8, and 3.3e-6 with the float32-product sums
collection stored as ``Σ_k`` against the exact ``Σ_U⁺``), and on sums groups the same as
``test_universe_build`` (their ``Σ`` is the sum collection stored).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors import safe_open

from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.engine.checkpoint import CheckpointReader
from service.engine.collect import LayerStatistics
from service.engine.layout import ModelLayout
from service.storage.keys import engram_key, group_key, universe_prefix
from service.universes import factors as factors_module
from service.universes.build import ensure_universe
from service.universes.factors import load_factors
from service.universes.service import submit_universe
from tests.helpers.algebra import reference_engram, reference_pinv, rel
from tests.helpers.store_world import StoreWorld, text_records

FACTOR_TOL = 1e-9
FLOAT32_ENGRAM_TOL = 1.2e-7


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("universe-rows")
    w = StoreWorld(root)
    path = make_tiny_llama(root / "models" / "llama", hidden=64, layers=2, seed=1, tokenizer=make_tokenizer())
    w.register("r/llama", path)
    stats = {"one": w.publish("r/llama", "one", text_records(0, 1)), "two": w.publish("r/llama", "two", text_records(1, 2))}
    return {"world": w, "path": path, "stats": stats}


def exact(stats: LayerStatistics, group: str) -> torch.Tensor:
    """``XᵀX`` of a concept's rows, in float64 (the rows are what collection kept)."""
    x = stats.factors[group].double()
    return x.mT @ x


def test_narrow_universes_are_decomposed_from_rows(world: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    w: StoreWorld = world["world"]
    stats: dict[str, LayerStatistics] = world["stats"]
    one = stats["one"]
    assert set(one.factors) == set(one.sums), "one record: every group is stored as rows"
    tokens = {g: sum(s.counts[g] for s in stats.values()) for g in one.sums}
    narrow = {g for g, t in tokens.items() if t < one.sums[g].shape[0]}
    assert narrow and narrow != set(one.sums), f"some groups narrow, some not: {tokens}"

    calls: dict[str, list[int]] = {"sums": [], "rows": []}
    real_sums, real_rows = factors_module.pinv_factors, factors_module.pinv_factors_from_rows
    monkeypatch.setattr(factors_module, "pinv_factors", lambda s, *a: calls["sums"].append(s.shape[0]) or real_sums(s, *a))
    monkeypatch.setattr(
        factors_module, "pinv_factors_from_rows", lambda x, *a: calls["rows"].append(x.shape[1]) or real_rows(x, *a)
    )
    view, job = submit_universe(w.ctx, "r/llama", None, None)
    assert job is not None
    [done] = w.run_pending()
    assert done.status == "succeeded", done
    manifest = w.ctx.storage.get_json(universe_prefix(view.universe_id) + "manifest.json")

    assert {g for g, info in manifest["groups"].items() if info["source"] == "rows"} == narrow
    assert len(calls["rows"]) == len(narrow) and len(calls["sums"]) == len(one.sums) - len(narrow)
    assert 128 not in calls["sums"], "no 128 x 128 eigendecomposition"
    for group, info in manifest["groups"].items():
        factors = load_factors(w.ctx.storage.local_path(group_key(view.universe_id, group)))
        universe = (
            sum(exact(s, group) for s in stats.values()) if group in narrow else sum(s.sums[group] for s in stats.values())
        )
        eye = torch.eye(info["dim"], dtype=torch.float64)
        assert factors.rank == info["rank"]
        assert rel(factors.apply_right(eye), reference_pinv(universe)) < FACTOR_TOL, group
        if group in narrow:
            assert info["rank"] <= tokens[group] < info["dim"]


def test_engrams_of_rows_groups_use_the_members_exact_sums(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    stats: dict[str, LayerStatistics] = world["stats"]
    manifest, existed = ensure_universe(w.ctx, _universe_id(w))
    assert existed
    model = w.ctx.storage.get_json("models/r%2Fllama.json")
    reader = CheckpointReader(world["path"], ModelLayout.from_json(model["layout"]))
    keys = {m.names[0]: m.key for m in manifest.members}
    worst = {"rows": 0.0, "sums": 0.0}
    for name, member in stats.items():
        with safe_open(str(w.ctx.storage.local_path(engram_key(manifest.universe_id, keys[name]))), "pt") as handle:
            for spec in reader.layout.layers:
                group = member.layer_group[spec.name]
                source = manifest.groups[group].source
                if source == "rows":
                    target, universe = exact(member, group), sum(exact(s, group) for s in stats.values())
                else:
                    target, universe = member.sums[group], sum(s.sums[group] for s in stats.values())
                expected = reference_engram(spec, reader.layer_weights(spec), target, universe)
                error = rel(handle.get_tensor(spec.name).double(), expected)
                worst[source] = max(worst[source], error)
                assert error < FLOAT32_ENGRAM_TOL, (name, spec.name, source, error)
    print(f"worst relative engram error: {worst}")  # noqa: T201 - the tolerance's measure


def _universe_id(w: StoreWorld) -> str:
    view, job = submit_universe(w.ctx, "r/llama", None, None)
    assert job is None and view.status == "ready"
    return str(view.universe_id)
