"""A collection is resolved once: the submission stores its plan in the job's payload, the job runs it.

The plan's statistics key is the key the concept records (and the digest of the settings the payload
holds), its layers are those the posted modules select (told here by name, independently of the
service's selection), and a dataset reference's first row is the row messages count from. A job
queued before plans were stored (its payload without one) is planned when it runs, the same plan,
and collects the same statistics. The settings are read once per job (``CollectionSpec.of_job``),
and not at all at submission.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from service.concepts.plan import read_collection
from service.concepts.service import find_concept, submit_concept
from service.datasets.refs import submitted_reference
from service.datasets.spool import spool_records
from service.jobs.collect_plan import CollectionPlan
from service.jobs.records import CollectPayload, JobRecord
from service.jobs.store import new_job
from service.models.registry import get_model
from service.statistics.key import StatsKey, statistics_key
from service.statistics.manifest import stats_manifest
from service.statistics.spec import CollectionSpec
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "plan/tiny"


@pytest.fixture
def world(tmp_path: Path) -> StoreWorld:
    world = StoreWorld(tmp_path)
    world.tiny_llama(MODEL, {})
    return world


@pytest.fixture
def of_job_calls(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every call of ``CollectionSpec.of_job`` from now on."""
    calls: list[object] = []
    original = vars(CollectionSpec)["of_job"].__func__

    def counted(cls: type[CollectionSpec], settings: object) -> CollectionSpec:
        calls.append(settings)
        return original(cls, settings)

    monkeypatch.setattr(CollectionSpec, "of_job", classmethod(counted))
    return calls


def submit_inline(world: StoreWorld, name: str, modules: list[str] | None) -> JobRecord:
    raw = [r.to_json() for r in text_records(0, 24)]
    spooled = spool_records(raw, world.root / f"{name}.jsonl", max_records=1000)
    _, jobs = submit_concept(
        world.ctx, name=name, role=None, description=None, dataset=spooled, models=[MODEL], modules=modules
    )
    return jobs[0]


def q_proj_layers(world: StoreWorld) -> tuple[str, ...]:
    """The layers a ``q_proj`` selection collects, told from the names alone."""
    names = [spec.name for spec in get_model(world.ctx, MODEL).layout.layers]
    picked = tuple(n for n in names if n.endswith(".q_proj"))
    assert len(picked) == 2 and len(names) > len(picked), names  # 2 blocks, and more layers than those
    return picked


def stored_layers(world: StoreWorld, prefix: str) -> set[str]:
    """The layers a published statistics file holds (its tensors are named ``<layer>...``)."""
    path = world.ctx.storage.local_path(statistics_key(prefix))
    assert path is not None
    with safe_open(str(path), "pt") as handle:
        return set(handle.keys())


def test_a_submission_stores_the_plan_its_job_runs(world: StoreWorld, of_job_calls: list[object]) -> None:
    job = submit_inline(world, "planned", ["q_proj"])
    assert of_job_calls == [], "a submission builds the settings; it does not read them back"
    payload = job.payload_of(CollectPayload)
    plan = payload.plan
    assert plan is not None and plan.layers == q_proj_layers(world) and plan.first_row is None
    assert plan.settings_digest == CollectionSpec.model_validate(payload.settings.dump()).digest()
    key = StatsKey(payload.model_digest, str(payload.dataset_digest), plan.settings_digest)
    concept = find_concept(world.ctx, "planned")
    assert concept is not None and concept.models[MODEL].stats == key.prefix

    [done] = world.run_pending()
    assert done.status == "succeeded", done.error
    assert len(of_job_calls) == 1, "the job reads its settings once"
    assert done.result is not None and done.result["stats"] == key.prefix and not done.result["reused"]
    manifest = stats_manifest(world.ctx, key.prefix)
    assert manifest is not None and manifest.layers == 2, "only the planned layers are collected"
    assert all(any(name.startswith(layer) for layer in plan.layers) for name in stored_layers(world, key.prefix))


def test_every_layer_is_planned_as_none(world: StoreWorld) -> None:
    payload = submit_inline(world, "whole", None).payload_of(CollectPayload)
    assert payload.plan is not None and payload.plan.layers is None
    stored = json.loads(payload.model_dump_json())
    assert "layers" not in stored["plan"] and "first_row" not in stored["plan"], "absent, not null"
    [done] = world.run_pending()
    manifest = stats_manifest(world.ctx, done.result["stats"] if done.result else "")
    assert manifest is not None and manifest.layers == len(get_model(world.ctx, MODEL).layout.layers)


def test_a_job_queued_without_a_plan_runs_as_planned(world: StoreWorld, of_job_calls: list[object]) -> None:
    planned = submit_inline(world, "old", ["q_proj"]).payload_of(CollectPayload)
    world.pending.clear()
    old = planned.model_copy(update={"plan": None})
    assert "plan" not in json.loads(old.model_dump_json()), "stored as a payload queued before plans"
    assert read_collection(world.ctx, old).plan == planned.plan
    of_job_calls.clear()
    job = world.ctx.jobs.create(new_job("collect", old, unit="tokens"))
    world.ctx.dispatch(job)
    [done] = world.run_pending()
    assert done.status == "succeeded", done.error
    assert len(of_job_calls) == 1
    assert done.result is not None and done.result["stats"] == find_concept(world.ctx, "old").models[MODEL].stats  # type: ignore[union-attr]
    assert stats_manifest(world.ctx, done.result["stats"]).layers == 2  # type: ignore[union-attr]


def test_a_reference_plans_its_first_row(world: StoreWorld, of_job_calls: list[object]) -> None:
    data = world.root / "data"
    data.mkdir()
    file = data / "facts.jsonl"
    file.write_text("".join(json.dumps(r.to_json()) + "\n" for r in text_records(0, 30)))
    world.ctx = dataclasses.replace(world.ctx, settings=world.ctx.settings.model_copy(update={"dataset_roots": str(data)}))
    reference = submitted_reference({"uri": f"file://{file}", "rows": {"start": 3, "stop": 20}}, world.ctx.settings)
    _, [job] = submit_concept(
        world.ctx, name="ref", role=None, description=None, dataset=None, models=[MODEL], reference=reference
    )
    payload = job.payload_of(CollectPayload)
    assert payload.plan == CollectionPlan(settings_digest=payload.plan.settings_digest, first_row=3)  # type: ignore[union-attr]
    assert payload.dataset_digest is None and find_concept(world.ctx, "ref").models[MODEL].stats is None  # type: ignore[union-attr]
    assert read_collection(world.ctx, payload.model_copy(update={"plan": None})).plan == payload.plan
    of_job_calls.clear()

    [done] = world.run_pending()
    assert done.status == "succeeded", done.error
    assert len(of_job_calls) == 1, "resolving the reference reads no settings again"
    concept = find_concept(world.ctx, "ref")
    assert concept is not None and concept.num_records == 17
    assert done.result is not None and concept.models[MODEL].stats == done.result["stats"]
    # A payload queued without a plan after the reference was resolved: the first row from the concept.
    resolved = payload.model_copy(update={"plan": None, "dataset": None, "dataset_digest": concept.dataset_digest})
    assert read_collection(world.ctx, resolved).plan == payload.plan
