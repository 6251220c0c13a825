"""A request waits only for what it needs (issue 27): a variant of some modules on a new universe
builds only the input groups of the layers it edits (a stage), the others are deferred until a
request needs them, and every variant still equals the float64 formula.

Through the real job bodies on a store world (tests.helpers.variants): a tiny Llama whose layers
have four input groups each (attention input: q/k/v; o_proj's; the MLP input: gate/up; down_proj's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from api_schemas import Variant
from service.engrams.manifest import GroupNotBuilt, MalformedManifest, read_manifest
from service.storage.keys import engram_key, group_key, part_key, universe_prefix
from service.universes import holdings, retention
from service.universes import parts as parts_module
from service.universes.build import ensure_universe, help_build_universe
from service.universes.parts import UniverseBuild, stage_name
from service.universes.records import build_target_key, find_manifest, find_stages
from service.universes.service import submit_universe, universe_view
from tests.helpers.algebra import WEIGHT_TOL
from tests.helpers.store_world import StoreWorld
from tests.helpers.universes import leased_build, run_on_threads, watch_decompositions
from tests.helpers.variants import ALPHA, assert_matches, build, layout_of, reference_edit
from tests.helpers.variants import world as world  # noqa: PLC0414  (the shared module-scoped fixture)

MODEL = "v/llama"
REFERENCE = ["forget", "retain"]
TERMS = {"forget": -ALPHA}


def assert_module_edit(world: dict[str, Any], variant: Variant, modules: list[str], terms: dict[str, float] = TERMS) -> None:
    """The variant's layers of ``modules`` equal base + the float64 edit (uniform scaling, the universe
    ``REFERENCE``); every other layer is the base's, bit for bit."""
    engrams, _ = reference_edit(world, MODEL, terms, REFERENCE, "uniform")
    assert_matches(world, MODEL, variant, engrams, WEIGHT_TOL, modules=modules)


def _groups_of(w: StoreWorld, universe_id: str, module: str) -> set[str]:
    """The plan's input groups whose layers are ``module`` layers."""
    build = UniverseBuild.open(w.ctx, universe_id)
    return {g for g, layers in build.plan.groups.items() if any(n.endswith("." + module) for n in layers)}


def _stored_groups(w: StoreWorld, universe_id: str) -> set[str]:
    build = UniverseBuild.open(w.ctx, universe_id)
    return {g for g in build.plan.groups if w.ctx.storage.exists(group_key(universe_id, g))}


def _progress_groups(w: StoreWorld, variant: Variant) -> dict[str, set[str]]:
    job = w.ctx.jobs.get(variant.job_id)
    assert job is not None and job.progress.groups is not None, "the job's progress names the groups"
    return {"built": set(job.progress.groups.built), "deferred": set(job.progress.groups.deferred)}


@pytest.fixture(scope="module")
def first(world: dict[str, Any]) -> Variant:
    """A Q/K+Gate variant on a new universe (nothing of it built before)."""
    w: StoreWorld = world["world"]
    variant = build(w, MODEL, TERMS, reference=REFERENCE, modules=["q_proj", "k_proj", "gate_proj"])
    return variant


def test_a_q_k_gate_request_builds_only_the_attention_and_mlp_input_groups(world: dict[str, Any], first: Variant) -> None:
    w: StoreWorld = world["world"]
    uid = first.universe_id
    needed = _groups_of(w, uid, "q_proj") | _groups_of(w, uid, "gate_proj")
    down = _groups_of(w, uid, "down_proj")
    others = set(UniverseBuild.open(w.ctx, uid).plan.groups) - needed  # o_proj's, down_proj's, lm_head's
    assert down and down <= others and needed
    assert _stored_groups(w, uid) == needed, "down_proj's (and o_proj's) inputs not decomposed"
    assert not any(w.ctx.storage.exists(part_key(uid, "group", g)) for g in others), "no part record either"
    assert find_manifest(w.ctx, uid) is None, "a partial universe has no manifest.json: it is not built"
    assert not w.ctx.storage.exists(universe_prefix(uid) + "manifest.json")
    [stage] = find_stages(w.ctx, uid)
    assert set(stage.groups) == needed and set(stage.deferred) == others
    held = {n for g in needed for n in UniverseBuild.open(w.ctx, uid).plan.groups[g]}
    assert set(stage.layers) == held
    for member in stage.engrams.values():
        [(name, layers)] = (member.files or {}).items()
        assert set(layers) == held and w.ctx.storage.exists(engram_key(uid, name))
    assert _progress_groups(w, first) == {"built": needed, "deferred": others}
    view = universe_view(w.ctx, uid)
    assert view.status == "partial" and view.groups.done == len(needed)
    stored = holdings.stored_universe(w.ctx, uid, current=False, busy=False)
    assert stored is not None and stored.status == "partial" and stored.stored > 0, "counted, and not as failed"


def test_the_partial_variant_equals_the_float64_formula(world: dict[str, Any], first: Variant) -> None:
    assert_module_edit(world, first, ["q_proj", "k_proj", "gate_proj"])


def test_a_partial_universe_refuses_a_deferred_layer_by_name(world: dict[str, Any], first: Variant) -> None:
    w: StoreWorld = world["world"]
    uid = first.universe_id
    [stage] = find_stages(w.ctx, uid)
    down_layer = next(n for n in layout_of(w, MODEL).weight_keys if n.endswith("down_proj"))
    with pytest.raises(GroupNotBuilt, match=f"layer {down_layer} of universe {uid}: its input group .* not built"):
        stage.weight_norm(down_layer)
    with pytest.raises(MalformedManifest, match="partial"):  # as manifest.json, a stage is refused
        read_manifest(uid, stage.to_json())


def test_a_down_proj_request_builds_the_deferred_group_and_equals_the_formula(world: dict[str, Any], first: Variant) -> None:
    w: StoreWorld = world["world"]
    uid = first.universe_id
    before = _stored_groups(w, uid)
    variant = build(w, MODEL, TERMS, reference=REFERENCE, modules=["down_proj"])
    assert variant.universe_id == uid
    down = _groups_of(w, uid, "down_proj")
    assert _stored_groups(w, uid) == before | down
    rest = set(UniverseBuild.open(w.ctx, uid).plan.groups) - before - down
    assert _progress_groups(w, variant) == {"built": down, "deferred": rest}
    assert find_manifest(w.ctx, uid) is None, "o_proj's inputs are still deferred"
    assert_module_edit(world, variant, ["down_proj"])
    again = build(w, MODEL, {"forget": -0.5}, reference=REFERENCE, modules=["k_proj", "down_proj"])
    assert _stored_groups(w, uid) == before | down, "groups built by earlier stages are read, not built again"
    assert _progress_groups(w, again)["built"] == set()


def test_the_universe_job_builds_the_rest_and_writes_the_whole_manifest(world: dict[str, Any], first: Variant) -> None:
    w: StoreWorld = world["world"]
    uid = first.universe_id
    with pytest.MonkeyPatch.context() as patch:
        decomposed = watch_decompositions(patch).groups
        view, job = submit_universe(w.ctx, MODEL, REFERENCE, None)
        assert view.universe_id == uid and job is not None
        [done] = w.run_pending()
    assert done.status == "succeeded", done
    rest = set(UniverseBuild.open(w.ctx, uid).plan.groups) - _groups_of(w, uid, "q_proj")
    rest -= _groups_of(w, uid, "gate_proj") | _groups_of(w, uid, "down_proj")
    assert len(decomposed) == len(rest) and rest, "only the groups no stage built"
    manifest = find_manifest(w.ctx, uid)
    assert manifest is not None and not manifest.partial
    assert set(manifest.groups) == set(UniverseBuild.open(w.ctx, uid).plan.groups)
    assert set(manifest.layers) == set(layout_of(w, MODEL).weight_keys)
    assert universe_view(w.ctx, uid).status == "ready"
    # every layer of the whole universe: the variant of every module equals the formula
    variant = build(w, MODEL, {"forget": -0.25}, reference=REFERENCE)
    engrams, _ = reference_edit(world, MODEL, {"forget": -0.25}, REFERENCE, "uniform")
    assert_matches(world, MODEL, variant, engrams, WEIGHT_TOL)
    variant = build(w, MODEL, {"forget": -0.25}, reference=REFERENCE, scaling="weight_norm")
    engrams, scales = reference_edit(world, MODEL, {"forget": -0.25}, REFERENCE, "weight_norm")
    assert_matches(world, MODEL, variant, {n: scales[n] * e for n, e in engrams.items()}, WEIGHT_TOL)


def test_ensure_universe_without_layers_completes_a_partial_universe(world: dict[str, Any]) -> None:
    """What calibration asks (every layer): a partial universe's remaining groups are built, once."""
    w: StoreWorld = world["world"]
    reference = ["forget", "other"]
    variant = build(w, MODEL, TERMS, reference=reference, modules=["gate_proj"])
    uid = variant.universe_id
    assert find_manifest(w.ctx, uid) is None and len(find_stages(w.ctx, uid)) == 1
    manifest, existed = ensure_universe(w.ctx, uid)
    assert not existed and not manifest.partial
    assert find_manifest(w.ctx, uid) == manifest
    assert ensure_universe(w.ctx, uid) == (manifest, True)


def test_a_stage_cut_short_resumes_without_redoing_its_parts(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    view, job = submit_universe(w.ctx, MODEL, ["retain", "other"], None)
    w.pending.clear()  # recorded, never run: nothing of it is built
    uid = view.universe_id
    layers = [n for n in layout_of(w, MODEL).weight_keys if n.endswith("q_proj")]
    real_member = UniverseBuild.compute_member

    def dies(self: UniverseBuild, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("killed")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(UniverseBuild, "compute_member", dies)
        with pytest.raises(RuntimeError, match="killed"):
            ensure_universe(w.ctx, uid, layers=layers)
    assert find_stages(w.ctx, uid) == [] and find_manifest(w.ctx, uid) is None, "no stage without its parts"
    with pytest.MonkeyPatch.context() as patch:
        decomposed = watch_decompositions(patch).groups
        patch.setattr(UniverseBuild, "compute_member", real_member)
        manifest, existed = ensure_universe(w.ctx, uid, layers=layers)
    assert decomposed == [] and not existed, "the groups published before the crash are read"
    assert manifest.partial and set(manifest.groups) == _groups_of(w, uid, "q_proj")


def test_two_builders_of_one_stage_compute_each_part_once(
    world: dict[str, Any], redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w: StoreWorld = world["world"]
    view, _ = submit_universe(w.ctx, MODEL, ["forget", "retain", "other"], 1e-3)
    w.pending.clear()
    uid = view.universe_id
    computed = watch_decompositions(monkeypatch, delay_s=0.05)
    whole = [leased_build(w.ctx, redis_client, uid) for _ in range(2)]
    builds = [b.for_stage(_groups_of(w, uid, "gate_proj") | _groups_of(w, uid, "down_proj")) for b in whole]
    assert builds[0].stage_name == builds[1].stage_name == stage_name(builds[0].stage) != ""
    run_on_threads(builds, tmp_path)
    assert len(computed.groups) == len(builds[0].stage), "each group of the stage decomposed once"
    assert sum(b.computed["members"] for b in builds) == len(builds[0].member_of), "each member's engrams once"
    assert _stored_groups(w, uid) == set(builds[0].stage), "no group outside the stage"


def test_an_evicted_partial_universe_loses_its_stages_first_and_is_built_again_on_need(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    options = {"reference": ["other", "retain"], "modules": ["q_proj"], "rcond": 1e-2}
    variant = build(w, MODEL, {"other": -0.5}, **options)
    uid = variant.universe_id
    assert universe_view(w.ctx, uid).status == "partial"
    deleted: list[str] = []
    real_delete = w.ctx.storage.delete

    def recording(key: str) -> None:
        deleted.append(key)
        real_delete(key)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(w.ctx.storage, "delete", recording)
        with w.ctx.lock:
            freed = retention.evict_universe(w.ctx, uid, reason="test")
    assert freed > 0
    stage_keys = [i for i, key in enumerate(deleted) if "/stages/" in key]
    part_keys = [i for i, key in enumerate(deleted) if "/groups/" in key or "/engrams/" in key]
    assert stage_keys and max(stage_keys) < min(part_keys), "the stage goes before the parts it names"
    assert find_stages(w.ctx, uid) == [] and _stored_groups(w, uid) == set()
    assert universe_view(w.ctx, uid).status == "evicted"
    again = build(w, MODEL, {"other": -0.6}, **options)
    assert again.universe_id == uid and universe_view(w.ctx, uid).status == "partial"
    assert _stored_groups(w, uid) == _groups_of(w, uid, "q_proj")


def test_a_helper_of_a_stage_builds_that_stage_only(world: dict[str, Any], tmp_path: Path) -> None:
    """A job building one stage records its groups: an idle worker asked to help computes those
    groups and the members' engrams of their layers, not the groups the job defers."""
    w: StoreWorld = world["world"]
    view, builder = submit_universe(w.ctx, MODEL, ["forget", "other"], 1e-2)
    w.pending.clear()  # recorded, never run: the helper alone computes
    assert builder is not None
    uid = view.universe_id
    groups = sorted(_groups_of(w, uid, "gate_proj"))
    w.ctx.storage.put_json(build_target_key(uid, builder.job_id), {"groups": groups})
    computed = help_build_universe(w.ctx, uid, builder.job_id)
    assert computed == {"groups": len(groups), "members": 2}
    assert _stored_groups(w, uid) == set(groups)
    layers = [n for n in layout_of(w, MODEL).weight_keys if n.endswith(("gate_proj", "up_proj"))]
    with pytest.MonkeyPatch.context() as patch:
        decomposed = watch_decompositions(patch).groups
        patch.setattr(parts_module, "write_member_engrams", lambda *a, **k: pytest.fail("engrams computed again"))
        manifest, existed = ensure_universe(w.ctx, uid, layers=layers)
    assert decomposed == [] and not existed, "the job finds its stage's parts published by the helper"
    assert set(manifest.groups) == set(groups) and set(manifest.layers) == set(layers)
