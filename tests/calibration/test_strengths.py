"""The ``data_weighted`` arms: module types' strengths from the data-weighted memory-trace map.

``ρ_l = sqrt(tr(E Σ_U Eᵀ) / tr([W|b] Σ_U [W|b]ᵀ))`` is checked against the float64 formula on the
collected statistics and against the map (``GET …/engram-map?measure=data``); a weighted candidate's
weights against the variant built with its ``module_strengths``, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from service.calibration.candidates import InMemoryCandidates
from service.calibration.space import arm_layers, edit_space
from service.calibration.strengths import STRENGTH_FLOOR, data_weighted_rho, measure_strengths, type_strengths
from service.engine.checkpoint import CheckpointReader
from service.engine.evaluate import TextProbe as Probe
from service.engine.layers import LayerSpec, module_type
from service.engrams.manifest import UniverseManifest
from service.engrams.store import stored_engrams
from service.maps.build import engram_map
from service.statistics.local import statistics
from service.universes.records import find_manifest
from tests.helpers.algebra import augmented
from tests.helpers.store_world import StoreWorld
from tests.helpers.variants import build, checkpoint_of, layout_of, manifest_of, reference_edit
from tests.helpers.variants import world as world  # noqa: PLC0414  (the shared module-scoped fixture)

MODEL = "v/llama"
UNIVERSE = ["forget", "retain"]


def spec(name: str, block: int | None) -> LayerSpec:
    return LayerSpec(name, 8, 8, False, False, block)


LAYERS = [
    spec("model.layers.0.self_attn.q_proj", 0),
    spec("model.layers.0.mlp.gate_proj", 0),
    spec("model.layers.0.mlp.down_proj", 0),
    spec("model.layers.1.self_attn.q_proj", 1),
    spec("model.layers.1.mlp.gate_proj", 1),
    spec("model.layers.1.mlp.down_proj", 1),
    spec("lm_head", None),
]


def test_a_types_strength_is_its_mean_rho_relative_to_the_largest() -> None:
    rho = {
        "model.layers.0.self_attn.q_proj": 0.2,
        "model.layers.1.self_attn.q_proj": 0.4,
        "model.layers.0.mlp.down_proj": 0.1,
        "model.layers.1.mlp.down_proj": 0.1,
        "lm_head": 0.0,
    }
    assert type_strengths(rho) == {"lm_head": STRENGTH_FLOOR, "mlp.down_proj": 0.333, "self_attn.q_proj": 1.0}


def test_an_engram_that_removes_nothing_gives_no_strengths() -> None:
    with pytest.raises(ValueError, match="removes nothing"):
        type_strengths({"model.layers.0.self_attn.q_proj": 0.0})


def test_data_weighted_is_a_preset_of_every_layer_whose_arms_are_weighted() -> None:
    default = edit_space(LAYERS, None, None, ["uniform", "weight_norm"])
    weighted = [arm for arm in default.arms if arm.weighted]
    assert [arm.name for arm in weighted] == ["data_weighted/uniform", "data_weighted/weight_norm"]
    assert all(arm.modules is None and arm.strengths == () for arm in weighted)
    assert arm_layers(LAYERS, weighted[0]) == LAYERS
    chosen = edit_space(LAYERS, ["all", "qk_gate", ["q_proj"]], [[1]], ["uniform"])
    assert [arm.name for arm in chosen.arms] == ["all@1/uniform", "qk_gate@1/uniform", "q_proj@1/uniform"]
    assert not any(arm.weighted for arm in chosen.arms)


# ---------------------------------------------------------------- on a built universe


def float64_rho(world: dict[str, Any], layers: list[LayerSpec]) -> dict[str, float]:
    """``ρ_l`` of the forget concept's engram from the collected statistics, every product in float64."""
    engrams, _ = reference_edit(world, MODEL, {"forget": 1.0}, UNIVERSE, "uniform")
    stats = world["stats"][MODEL]
    reader = CheckpointReader(world["paths"][MODEL], layout_of(world["world"], MODEL))
    rho = {}
    for layer in layers:
        sigma = sum(stats[n].sum_for(layer.name).double() for n in UNIVERSE)
        w, e = augmented(layer, reader.layer_weights(layer)), engrams[layer.name]
        rho[layer.name] = math.sqrt(float(torch.trace(e @ sigma @ e.T)) / float(torch.trace(w @ sigma @ w.T)))
    return rho


@pytest.fixture(scope="module")
def universe(world: dict[str, Any]) -> UniverseManifest:
    """The built universe ``forget ∪ retain`` of the tiny Llama (built by its first variant)."""
    w: StoreWorld = world["world"]
    variant = build(w, MODEL, {"forget": -1.0}, reference=UNIVERSE)
    manifest = find_manifest(w.ctx, variant.universe_id)
    assert manifest is not None
    return manifest


def forget_prefix(w: StoreWorld) -> str:
    return str(w.ctx.storage.get_json("concepts/forget.json")["models"][MODEL]["stats"])


def test_rho_is_the_float64_formula_and_the_maps_data_measure(world: dict[str, Any], universe: UniverseManifest) -> None:
    w: StoreWorld = world["world"]
    layout = layout_of(w, MODEL)
    members = [statistics(w.ctx, prefix) for prefix in universe.member_prefixes]
    engrams = stored_engrams(w.ctx, universe, {forget_prefix(w): -0.5})  # as an unlearn term: ρ scales with |c|
    rho = data_weighted_rho(layout.layers, engrams, members, CheckpointReader(world["paths"][MODEL], layout))
    expected = float64_rho(world, layout.layers)
    assert set(rho) == set(expected)
    for name, value in rho.items():
        assert value == pytest.approx(0.5 * expected[name], rel=1e-5), name
        assert 0.0 < value < 1.0
    mapped = engram_map(w.ctx, MODEL, ["forget"], ["retain"], None, "data")
    grid = mapped["maps"]["forget"]["rho"]
    for layer in layout.layers:
        if layer.block is None:
            value = mapped["outside_blocks"]["forget"][layer.name]
        else:
            value = grid[mapped["blocks"].index(layer.block)][mapped["modules"].index(module_type(layer.name))]
        assert value == pytest.approx(expected[layer.name], rel=1e-5), layer.name


def test_a_weighted_arms_strengths_are_the_maps_type_means_over_its_layers(
    world: dict[str, Any], universe: UniverseManifest
) -> None:
    w: StoreWorld = world["world"]
    layout = layout_of(w, MODEL)
    space = edit_space(layout.layers, ["all", "data_weighted"], [[0, 1]], ["uniform"])
    reader = CheckpointReader(world["paths"][MODEL], layout)
    plain, weighted = measure_strengths(w.ctx, universe, [forget_prefix(w)], layout, reader, space.arms)
    assert plain == space.arms[0], "an arm that is not weighted is left as it was"
    layers = arm_layers(layout.layers, weighted)
    assert {spec.block for spec in layers} == {0, 1}, "the blocks' layers, two of each type, no lm_head"
    expected = float64_rho(world, layers)
    by_type: dict[str, list[float]] = {}
    for name, value in expected.items():
        by_type.setdefault(module_type(name), []).append(value)
    means = {module: sum(values) / len(values) for module, values in by_type.items()}
    top = max(means.values())
    strengths = dict(weighted.strengths)
    assert set(strengths) == set(means) and max(strengths.values()) == 1.0
    for module, mean in means.items():
        assert strengths[module] == pytest.approx(max(mean / top, STRENGTH_FLOOR), rel=2e-3), module  # 3 figures
    assert len(set(strengths.values())) > 1, "the fixture's module types differ: the test can tell them apart"


@pytest.mark.parametrize("scaling", ["uniform", "weight_norm"])
def test_a_weighted_candidate_is_the_variant_with_its_module_strengths(
    world: dict[str, Any], universe: UniverseManifest, scaling: str
) -> None:
    """The weights a candidate is evaluated with are those of the variant its recommendation builds."""
    w: StoreWorld = world["world"]
    layout = layout_of(w, MODEL)
    alpha = 0.7
    probes = {"forget": [Probe("The sky is", " blue")], "retain": [Probe("Grass is", " green")]}
    prefix = forget_prefix(w)
    candidates = InMemoryCandidates(w.ctx, world["paths"][MODEL], layout, universe, [prefix], probes, "cpu", layout.layers)
    space = edit_space(layout.layers, ["data_weighted"], None, [scaling])
    [arm] = measure_strengths(w.ctx, universe, [prefix], layout, candidates.reader, space.arms)
    candidates.measure(arm, alpha)
    variant = build(w, MODEL, {"forget": -alpha}, reference=UNIVERSE, scaling=scaling, module_strengths=dict(arm.strengths))
    assert variant.module_strengths == {k: v for k, v in arm.strengths if v != 1.0}
    assert manifest_of(w, variant)["scales"] == candidates.scales(arm, alpha)
    written = checkpoint_of(w, variant)
    for layer in layout.layers:
        key = layout.own_keys.get(layer.name, layout.weight_keys[layer.name])
        assert torch.equal(candidates.modules[layer.name].get_parameter("weight").detach(), written[key]), layer.name
