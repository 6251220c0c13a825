"""Variants by arithmetic on a universe's stored engrams, through the real job bodies.

Exactness is held to tests/engine/test_compose.py's bars: new weights within 1e-6 of the float64
formula (relative), the edit itself within 1e-4; the measured gap to today's statistics path
(:class:`EngramAlgebra`) is at the float32 rounding of the result (float32 engram storage adds
~3e-8 relative to an engram, see tests/universes). A float64 checkpoint's variant is held to 1e-10.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from service.engine import compose as compose_module
from service.engine.compose import EngramAlgebra, layer_edits
from service.engrams import store as stored_engrams_module
from service.universes import factors as factors_module
from service.universes.records import find_manifest, find_request
from service.universes.service import submit_universe
from tests.helpers.algebra import WEIGHT_TOL, canonical
from tests.helpers.store_world import StoreWorld
from tests.helpers.variants import (
    ALPHA,
    assert_matches,
    build,
    checkpoint_of,
    layout_of,
    manifest_of,
    new_weights,
    reference_edit,
)
from tests.helpers.variants import world as world  # noqa: PLC0414  (the shared module-scoped fixture)

FLOAT64_TOL = 1e-10


def reference_deltas(
    world: dict[str, Any], model_id: str, terms: dict[str, float], universe: list[str], scaling: str
) -> dict[str, torch.Tensor]:
    """``f_l · Σ_k c_k W Σ_k Σ_U⁺`` per layer, float64, with W-Norm's ρ from the float64 engram."""
    engrams, scales = reference_edit(world, model_id, terms, universe, scaling)
    return {n: scales[n] * e for n, e in engrams.items()}


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("scaling", ["uniform", "weight_norm"])
@pytest.mark.parametrize("model_id", ["v/llama", "v/gpt2", "v/llama64"])
def test_variant_from_stored_engrams_equals_the_float64_formula(world: dict[str, Any], model_id: str, scaling: str) -> None:
    w: StoreWorld = world["world"]
    terms = {"forget": -ALPHA}
    variant = build(w, model_id, terms, reference=["forget", "retain"], scaling=scaling)
    assert variant.universe_id and find_manifest(w.ctx, variant.universe_id) is not None
    expected = reference_deltas(world, model_id, terms, ["forget", "retain"], scaling)
    tol = FLOAT64_TOL if model_id.endswith("64") else WEIGHT_TOL
    worst = assert_matches(world, model_id, variant, expected, tol)
    print(f"{model_id} {scaling}: worst relative edit error {worst:.2e}")  # noqa: T201
    _, reference_scales = reference_edit(world, model_id, terms, ["forget", "retain"], scaling)
    scales = manifest_of(w, variant)["scales"]
    assert scales == pytest.approx(reference_scales, rel=1e-6), "ρ of the stored (float32) engrams"
    if scaling == "weight_norm":
        assert max(scales.values()) == pytest.approx(1.0, rel=1e-12)
        assert min(scales.values()) < 0.9, "the schedule is not flat"


def test_variant_equals_the_statistics_path(world: dict[str, Any]) -> None:
    """The stored-engram variant and EngramAlgebra's (today's path) differ by float32 rounding only."""
    w: StoreWorld = world["world"]
    stats = world["stats"]["v/llama"]
    variant = build(w, "v/llama", {"forget": -ALPHA, "other": 0.3}, reference=["forget", "retain", "other"])
    layout = layout_of(w, "v/llama")
    from service.engine.checkpoint import CheckpointReader

    reader = CheckpointReader(world["paths"]["v/llama"], layout)
    algebra = EngramAlgebra([(-ALPHA, stats["forget"]), (0.3, stats["other"])], list(stats.values()))
    edits = {
        e.spec.name: e
        for e in layer_edits(
            layout.layers, algebra, reader.layer_weights, dict.fromkeys((s.name for s in layout.layers), 1.0)
        )
    }
    written = checkpoint_of(w, variant)
    for spec in layout.layers:
        ours, theirs = new_weights(spec, layout, written), canonical(edits[spec.name])
        ulp = torch.finfo(torch.float32).eps * theirs.abs().max()
        assert float((ours - theirs).abs().max()) <= float(ulp), spec.name


def test_any_subset_is_the_sum_of_its_members(world: dict[str, Any]) -> None:
    """One universe, every subset of two targets: each edit is the sum of the members' engrams."""
    w: StoreWorld = world["world"]
    universe = ["forget", "other", "retain"]
    singles = {k: reference_deltas(world, "v/gpt2", {k: -1.0}, universe, "uniform") for k in ("forget", "other")}
    for subset in (["forget"], ["other"], ["forget", "other"]):
        variant = build(w, "v/gpt2", dict.fromkeys(subset, -1.0), reference=universe)
        expected = {n: sum(singles[k][n] for k in subset) for n in singles["forget"]}
        assert_matches(world, "v/gpt2", variant, expected)
    ids = {build(w, "v/gpt2", dict.fromkeys(s, -1.0), reference=universe).universe_id for s in (["forget"], ["other"])}
    assert len(ids) == 1, "every subset of one universe uses its one set of engrams"


def test_signed_composition(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    terms = {"forget": 0.5, "other": -1.25}
    variant = build(w, "v/llama", terms, reference=["retain"], scaling="weight_norm")
    assert variant.terms == terms
    assert_matches(
        world, "v/llama", variant, reference_deltas(world, "v/llama", terms, ["forget", "other", "retain"], "weight_norm")
    )


def test_delta_and_peft_formats_carry_the_same_edit(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    common = {"reference": ["forget", "retain"], "modules": ["q_proj", "down_proj"]}
    full = checkpoint_of(w, build(w, "v/llama", {"forget": -1.0}, **common))
    delta_variant = build(w, "v/llama", {"forget": -1.0}, format="delta", **common)
    delta = load_file(str(w.ctx.storage.local_path(f"variants/{delta_variant.variant_id}/files/delta.safetensors")))
    assert sorted(delta) == sorted(
        f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")
    )
    for key, value in delta.items():
        assert torch.equal(value, full[key]), key
    peft = build(w, "v/llama", {"forget": -1.0}, format="peft", **common)
    report = manifest_of(w, peft)["lora"]
    assert report and all(layer["relative_error"] < 1e-5 for layer in report["layers"].values())


# ---------------------------------------------------------------- no decomposition once built


def _forbid(monkeypatch: pytest.MonkeyPatch, target: Any, name: str) -> None:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError(f"{name} ran on a variant of a built universe")

    monkeypatch.setattr(target, name, refuse)


def test_variants_of_a_built_universe_decompose_nothing_and_multiply_no_engram(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a universe is built, variants read engrams: no eigh, no pseudo-inverse, no W·Σ·Σ⁺."""
    w: StoreWorld = world["world"]
    universe = ["forget", "other", "retain"]
    view, job = submit_universe(w.ctx, "v/llama", universe, None)
    w.run_pending()
    assert find_manifest(w.ctx, view.universe_id) is not None
    for target, name in (
        (torch.linalg, "eigh"),
        (factors_module, "pinv_factors"),
        (compose_module, "pinv_factors"),
        (compose_module.EngramAlgebra, "engram"),
        (compose_module.EngramAlgebra, "factors"),
    ):
        _forbid(monkeypatch, target, name)
    for terms, scaling in (({"retain": -0.4}, "uniform"), ({"forget": -1.0, "other": -1.0}, "weight_norm")):
        variant = build(w, "v/llama", terms, universe=view.universe_id, scaling=scaling)
        assert variant.status == "ready" and variant.universe_id == view.universe_id


def test_the_first_variant_of_a_new_universe_builds_it(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    variant = build(w, "v/gpt2", {"other": -1.0}, reference=["other"])
    record = find_request(w.ctx, variant.universe_id)
    assert record is not None and record.job_id == variant.job_id, "the variant job built its universe"
    assert find_manifest(w.ctx, variant.universe_id) is not None
    job = w.ctx.jobs.get(variant.job_id)
    assert job is not None and job.result is not None and job.result["universe_built_s"] is not None
    assert job.progress.done == job.progress.total == len(layout_of(w, "v/gpt2").layers)


def test_weight_norm_of_several_terms_reads_pair_products_once_known(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-Norm of several terms: ``‖Σ c_k E_k‖`` from the members' norms and their pairs' inner
    products, computed once per pair and kept in the universe. The scales equal the combined
    engram's own norms; once the pairs are known, no layer's norm is computed from the engrams."""
    w: StoreWorld = world["world"]
    universe = ["forget", "other", "retain"]
    view, _ = submit_universe(w.ctx, "v/llama", universe, None)
    w.run_pending()
    universe_id = view.universe_id
    manifest = find_manifest(w.ctx, universe_id)
    assert manifest is not None
    terms = {"forget": -0.7, "other": 0.45, "retain": -0.2}
    prefixes = {m.key: m.stats for m in manifest.members}
    stats_of = {name: w.ctx.storage.get_json(f"concepts/{name}.json")["models"]["v/llama"]["stats"] for name in terms}
    assert set(stats_of.values()) <= set(prefixes.values())
    engrams = stored_engrams_module.stored_engrams(w.ctx, manifest, {stats_of[n]: c for n, c in terms.items()})
    layers = layout_of(w, "v/llama").layers
    direct = {spec.name: engrams.norm(spec) for spec in layers}  # the combined engram, read layer by layer
    w.ctx.storage.delete_prefix(f"universes/{universe_id}/pairs/")  # earlier W-Norm variants of this universe made some
    from_pairs = stored_engrams_module.relative_norms(layers, engrams, manifest)
    weight_norms = {spec.name: manifest.weight_norm(spec.name) for spec in layers}
    for name, norm in direct.items():
        assert from_pairs[name] * weight_norms[name] == pytest.approx(norm, rel=1e-9, abs=1e-12), name
    assert len(w.ctx.storage.list(f"universes/{universe_id}/pairs/")) == 3  # one file per pair of terms
    _forbid(monkeypatch, stored_engrams_module.StoredEngrams, "norm")
    for subset in ({"forget": -1.0, "other": -1.0}, terms):
        variant = build(w, "v/llama", subset, universe=universe_id, scaling="weight_norm")
        assert variant.status == "ready"
        assert_matches(world, "v/llama", variant, reference_deltas(world, "v/llama", subset, universe, "weight_norm"))
