"""A variant's plan: the request resolved once at submit, stored, and run by the job as it is.

The pinned IDs were computed by ``VariantRequest.new`` at commit 2fcef8c, before plans existed, from
the options as ``submit_variant`` normalised them (tests/variants/test_variant_spec.py pins the
older cases the same way): a stored variant keeps its ID only while these stay equal. The store
tests run the real submit and job on a tiny Llama; the layers a selection names are computed here
from the checkpoint's own tensor names, not by the selection code.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from safetensors import safe_open

from api_schemas import EditOptions
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.engine.layers import select_layers
from service.errors import JobFailed
from service.jobs.records import JobRecord
from service.models.registry import get_model
from service.statistics.cover import unreached_by_every
from service.storage.keys import variant_manifest_key, variant_plan_key, variant_request_key
from service.universes.members import EditUniverse
from service.universes.spec import Member, UniverseSpec
from service.variants import plan as plan_module
from service.variants.migrate import migrate_store
from service.variants.plan import PlanTerm, VariantPlan
from service.variants.service import find_variant_request, submit_variant
from service.variants.spec import VariantRequest, VariantSpec
from tests.helpers.store_world import StoreWorld, text_records
from tests.helpers.variant_requests import CASES, COMPOSE, MODEL, PINNED, UNLEARN, stats, universe

MORE_CASES: dict[str, dict[str, Any]] = {
    "gguf": {"format": "gguf"},
    "gguf_q8": {"format": "gguf", "gguf_quantization": "Q8_0"},
    "peft_base": {"format": "peft", "adapter_base_model": "org/base"},
    "peft_vllm_base_rank": {"format": "peft", "lora_target": "vllm", "lora_rank": 16, "adapter_base_model": "org/base"},
    "delta_layers_strengths": {"format": "delta", "layers": [1], "module_strengths": {"q_proj": 0.5}},
}
MORE_PINNED = {
    "gguf/unlearn": "931d8c25bc68148b6b0e37d12ba24de4",
    "gguf/compose": "a8d8761a65fe6e468737349132062798",
    "gguf_q8/unlearn": "8d423fb5ec5d019751cdc9f2d42e1039",
    "gguf_q8/compose": "dd6632ce2bfa70bd1c74069125386c14",
    "peft_base/unlearn": "39cbce2a2a9da014332727681beb3e03",
    "peft_base/compose": "34a116a7fddaff055035000e8ca189a3",
    "peft_vllm_base_rank/unlearn": "482b47bb560827dfd293de27f58e3dea",
    "peft_vllm_base_rank/compose": "08db04b6647f9668b48a3e050544bf97",
    "delta_layers_strengths/unlearn": "c6392385c81e73428a0e4fa199f8e30d",
    "delta_layers_strengths/compose": "74c443fa7d0eb4d1c5445e2076af5007",
}


def plan_of(options: dict[str, Any], kind: tuple[dict[str, float], float | None, float | None]) -> VariantPlan:
    """The plan submit makes, without a store: no layer is reached by nothing here."""
    terms, alpha, rcond = kind
    resolved = universe(rcond)
    request = VariantRequest.new(MODEL, terms, alpha, VariantSpec.from_options(EditOptions(**options)), resolved)
    return VariantPlan.new(MODEL, request, [(m.name, m.stats) for m in resolved.spec.members], ())


@pytest.mark.parametrize("case", sorted({**PINNED, **MORE_PINNED}))
def test_a_plan_names_every_request_kind_by_the_id_it_had_before_plans(case: str) -> None:
    name, kind = case.split("/")
    planned = plan_of({**CASES, **MORE_CASES}[name], UNLEARN if kind == "unlearn" else COMPOSE)
    assert planned.variant_id == {**PINNED, **MORE_PINNED}[case]
    stored = json.loads(json.dumps(planned.model_dump(mode="json")))
    assert VariantPlan.stored(variant_plan_key(planned.variant_id), stored) == planned  # the job reads what submit wrote


def test_terms_of_one_statistics_are_summed_once_in_the_order_named() -> None:
    """Two names of one statistics are one engram: the plan keys terms by prefix once, summing them."""
    members = (Member("forget", stats("a"), "a" * 64), Member("other", stats("b"), "b" * 64))
    spec = UniverseSpec("demo/tiny", "d" * 64, members, None)
    resolved = EditUniverse(spec, {"other": stats("b"), "forget": stats("a"), "alias": stats("a")}, [])
    terms = {"other": 0.25, "forget": -1.0, "alias": -0.5}
    request = VariantRequest.new(MODEL, terms, None, VariantSpec(), resolved)
    planned = VariantPlan.new(MODEL, request, [(m.name, m.stats) for m in members], ())
    assert planned.terms == (
        PlanTerm(stats=stats("b"), coefficient=0.25, names=("other",)),
        PlanTerm(stats=stats("a"), coefficient=-1.5, names=("forget", "alias")),
    )
    assert list(planned.coefficients.items()) == [(stats("b"), 0.25), (stats("a"), -1.5)]


# ---------------------------------------------------------------- submit and job on a store

LLAMA = "p/llama"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    root = tmp_path_factory.mktemp("variant-plan")
    w = StoreWorld(root)
    w.register(LLAMA, make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=make_tokenizer()))
    w.publish(LLAMA, "forget", text_records(0, 20))
    w.publish(LLAMA, "retain", text_records(20, 60))
    return w


def checkpoint_layers(w: StoreWorld, pattern: str) -> list[str]:
    """The 2-D weights of the checkpoint whose names match ``pattern``, read from its files."""
    names: list[str] = []
    for path in sorted(Path(get_model(w.ctx, LLAMA).path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names += [
                n.removesuffix(".weight") for n in f.keys() if n.endswith(".weight") and len(f.get_slice(n).get_shape()) == 2
            ]
    return sorted(n for n in names if re.fullmatch(pattern, n))


def submit(w: StoreWorld, alpha: float, **options: Any) -> tuple[str, JobRecord]:
    view, job = submit_variant(w.ctx, LLAMA, {"forget": -alpha}, alpha, {"format": "checkpoint", **options})
    assert job is not None and job.status == "queued"
    return view.variant_id, job


def finished(w: StoreWorld, job: JobRecord) -> JobRecord:
    (done,) = [j for j in w.run_pending() if j.job_id == job.job_id]
    return done


def test_submit_stores_the_plan_its_job_runs_without_selecting_or_reading_statistics(
    world: StoreWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    variant_id, job = submit(world, 1.0, modules=["q_proj", "down_proj"], layers=[1])
    planned = VariantPlan.stored(variant_plan_key(variant_id), world.ctx.storage.get_json(variant_plan_key(variant_id)))
    assert planned.request == find_variant_request(world.ctx, variant_id)  # the view's record, nested once
    assert sorted(planned.selected) == checkpoint_layers(world, r"model\.layers\.1\.(self_attn\.q_proj|mlp\.down_proj)")
    assert planned.unreached == () and planned.edited == planned.selected  # text concepts reach every layer
    assert planned.model_digest == get_model(world.ctx, LLAMA).digest
    forget = world.ctx.storage.get_json("concepts/forget.json")["models"][LLAMA]["stats"]
    assert planned.coefficients == {forget: -1.0}
    assert sorted(name for name, _ in planned.universe) == ["forget", "retain"]

    def decided_at_submit(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the job selected layers or read which layers the statistics reach")

    monkeypatch.setattr(plan_module, "select_layers", decided_at_submit)
    monkeypatch.setattr(plan_module, "unreached_by_every", decided_at_submit)
    done = finished(world, job)
    assert done.status == "succeeded", done.error
    manifest = world.ctx.storage.get_json(variant_manifest_key(variant_id))
    assert manifest.get("unreached_layers", []) == []  # stored only when some layer was not reached
    written = world.ctx.storage.list(f"variants/{variant_id}/files/")
    assert written, "the variant's files are stored"


def test_one_request_is_selected_named_and_resolved_once_at_submit_and_never_in_its_job(world: StoreWorld) -> None:
    """Every call of the selection, the unreached-layer read and the ID's hashing, by the function that
    made it (a profiler sees calls through any import name). ``statistics_layers`` selects the layers
    a statistics file holds by the modules it was collected with: the statistics' question, not the edit's."""
    watched = {
        select_layers.__code__: "select_layers",
        unreached_by_every.__code__: "unreached_by_every",
        VariantRequest.new.__func__.__code__: "VariantRequest.new",  # type: ignore[attr-defined]
    }
    calls: dict[str, Counter[str]] = {"submit": Counter(), "job": Counter()}
    phase = "submit"

    def count(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code in watched and frame.f_back is not None:
            calls[phase][f"{watched[frame.f_code]} from {frame.f_back.f_code.co_name}"] += 1

    options = {
        "format": "peft",
        "lora_target": "vllm",
        "lora_rank": 8,
        "modules": ["q_proj"],
        "module_strengths": {"q_proj": 0.5},
    }
    sys.setprofile(count)
    try:
        _, job = submit(world, 0.625, **options)
        phase = "job"
        done = finished(world, job)
    finally:
        sys.setprofile(None)
    assert done.status == "succeeded", done.error
    members = 2  # forget and retain: one statistics file each
    assert calls["submit"] == Counter(
        {
            "select_layers from new": 1,
            "unreached_by_every from plan_variant": 1,
            "VariantRequest.new from plan_variant": 1,
            "select_layers from statistics_layers": members,
        }
    )
    assert calls["job"] == Counter()


def test_a_job_whose_model_was_registered_again_with_other_weights_fails_naming_it(world: StoreWorld) -> None:
    variant_id, job = submit(world, 0.5)
    key = variant_plan_key(variant_id)
    world.ctx.storage.put_json(key, {**world.ctx.storage.get_json(key), "model_digest": "0" * 64})
    done = finished(world, job)
    assert done.status == "failed" and done.error is not None
    assert f"model {LLAMA} was registered again with other weights" in done.error.detail
    assert "planned with 000000000000" in done.error.detail
    assert not world.ctx.storage.exists(variant_manifest_key(variant_id))


def test_a_request_stored_before_plans_runs_once_migrated_and_fails_by_name_before(world: StoreWorld) -> None:
    """What a service before plans stored: the request and its queued job, no plan."""
    unmigrated, stale_job = submit(world, 0.25)
    migrated, job = submit(world, 0.75)
    written = world.ctx.storage.get_json(variant_plan_key(migrated))
    for variant_id in (unmigrated, migrated):
        world.ctx.storage.delete(variant_plan_key(variant_id))
    done = migrate_store(world.ctx)
    assert done.refused == []
    planned = {key: what for key, what in done.changed if key.startswith("variant-plans/")}
    assert sorted(planned) == sorted(variant_plan_key(v) for v in (unmigrated, migrated))
    assert world.ctx.storage.get_json(variant_plan_key(migrated)) == written, "the plan its submit would have made"
    assert migrate_store(world.ctx).changed == []  # once

    world.ctx.storage.delete(variant_plan_key(unmigrated))  # as if migrate had not run
    stale, ran = sorted(world.run_pending(), key=lambda j: j.job_id != stale_job.job_id)
    assert ran.job_id == job.job_id and ran.status == "succeeded", ran.error
    assert stale.status == "failed" and stale.error is not None
    assert "engram-service migrate" in stale.error.detail and variant_plan_key(unmigrated) in stale.error.detail
    assert world.ctx.storage.exists(variant_request_key(unmigrated))  # the request is left as it was


def test_a_plan_of_a_layer_the_layout_lacks_fails_naming_it() -> None:
    planned = plan_of({}, UNLEARN).model_copy(update={"selected": ("model.layers.9.mlp.up_proj",)})
    with pytest.raises(JobFailed, match=r"planned layer model\.layers\.9\.mlp\.up_proj is not a layer of model demo/tiny"):
        planned.layers(MODEL.layout)
