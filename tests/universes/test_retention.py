"""The universes' storage budget and retention rule, on real file storage with the real job bodies.

- The projection made before a build bounds what the build stores (engram files exactly, factor
  files from above by their headers' slack), for float32, float64 and Conv1D/bias checkpoints.
- A request over the budget is a 409 stating projected bytes and budget, and changes nothing.
- Unused universes are evicted least recently used first, only as many as needed; a model's
  current universe, one a running job needs, and one used within the retention age never are.
- An evicted universe shows as such, and is rebuilt on demand with the same IDs and the same bytes.
- The universe gauges show the stored bytes.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from safetensors import safe_open

from engram_fixtures.models import make_tiny_gpt2, make_tiny_llama, make_tokenizer
from service.concepts.service import ready_statistics
from service.context import Context
from service.models.registry import get_model
from service.storage.keys import universe_prefix, usage_key
from service.universes import retention
from service.universes.build import ensure_universe
from service.universes.projection import project_universe
from service.universes.records import current_pointer, find_request, find_usage
from service.universes.retention import UniverseBudgetExceeded, expire_unused, universe_storage
from service.universes.service import submit_universe, universe_view
from service.universes.spec import UniverseSpec, make_spec
from service.variants.service import submit_variant
from tests.helpers.store_world import StoreWorld, float64_copy, text_records

MODEL = "r/llama"
OPTIONS = {"scaling": "uniform", "format": "delta"}
CONCEPTS = {"a": (0, 20, 11), "b": (20, 50, 11), "c": (50, 70, 11), "d": (0, 25, 5)}
# A factor file's header beyond the tensors (the safetensors library's JSON): measured 150-190 bytes.
FACTOR_HEADER_BOUND = 8 + 256


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    """``r/llama`` with concepts a, b, c, d ready, and a float64 Llama and a GPT-2 with a, b."""
    root = tmp_path_factory.mktemp("retention")
    w = StoreWorld(root)
    tokenizer = make_tokenizer()
    llama = make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=tokenizer)
    w.register(MODEL, llama)
    w.register("r/llama64", float64_copy(llama, root / "models" / "llama64"))
    w.register("r/gpt2", make_tiny_gpt2(root / "models" / "gpt2", hidden=32, layers=2, seed=0, tokenizer=tokenizer))
    for name, (start, stop, seed) in CONCEPTS.items():
        w.publish(MODEL, name, text_records(start, stop, seed))
    for model_id in ("r/llama64", "r/gpt2"):
        w.publish(model_id, "a", text_records(0, 20))
        w.publish(model_id, "b", text_records(20, 50))
    return w


@pytest.fixture
def settings(world: StoreWorld, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set budget and retention for one test (the world's own settings come back after it)."""

    def apply(**values: Any) -> None:
        monkeypatch.setattr(world.ctx, "settings", world.ctx.settings.model_copy(update=values))

    return apply


def build(w: StoreWorld, model_id: str, names: list[str]) -> str:
    """POST /models/{model_id}/universes of ``names`` and run its job; returns the universe ID."""
    view, _ = submit_universe(w.ctx, model_id, names, None)
    for job in w.run_pending():
        assert job.status == "succeeded", job
    return str(view.universe_id)


def stored(w: StoreWorld) -> dict[str, tuple[int, int]]:
    """Every stored object (size, mtime): what a refused request must leave as it was."""
    root = Path(w.ctx.settings.storage_url.removeprefix("file://"))
    return {
        p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and ".tmp" not in p.parts
    }


def used_at(w: StoreWorld, universe_id: str, days_ago: float) -> None:
    """Backdate a universe's last use (the clock the retention rule reads)."""
    usage = find_usage(w.ctx, universe_id)
    usage["last_used"] = (datetime.now(timezone.utc) - timedelta(days=days_ago)).isoformat()
    w.ctx.storage.put_json(usage_key(universe_id), usage)


def stored_bytes(w: StoreWorld, universe_id: str) -> int:
    manifest = w.ctx.storage.find_json(universe_prefix(universe_id) + "manifest.json")
    return int(manifest["bytes"]["total"]) if manifest else 0


def spec_of(w: StoreWorld, universe_id: str) -> UniverseSpec:
    request = find_request(w.ctx, universe_id)
    assert request is not None
    return request.spec


def spec_for(w: StoreWorld, names: list[str]) -> UniverseSpec:
    """The universe of ``names`` on MODEL, as POST /models/{id}/universes resolves it."""
    return make_spec(get_model(w.ctx, MODEL), ready_statistics(w.ctx, MODEL, names), None)


def held_now(w: StoreWorld) -> int:
    return universe_storage(w.ctx).held()


# ---------------------------------------------------------------- projection


@pytest.mark.parametrize("model_id", [MODEL, "r/llama64", "r/gpt2"])
def test_the_projection_bounds_what_the_build_stores(world: StoreWorld, model_id: str) -> None:
    uid = build(world, model_id, ["a", "b"])
    projection = project_universe(world.ctx, spec_of(world, uid))
    manifest = world.ctx.storage.get_json(universe_prefix(uid) + "manifest.json")
    actual = manifest["bytes"]
    assert projection.assumed_float64 == 0, "the checkpoint is on this machine: every dtype read from it"
    assert projection.engrams == actual["engrams"], "engram files are laid out exactly as projected"
    slack = FACTOR_HEADER_BOUND * len(manifest["groups"])
    assert actual["groups"] <= projection.groups <= actual["groups"] + slack
    assert universe_view(world.ctx, uid).projected_bytes == projection.total, "recorded when requested"


# ---------------------------------------------------------------- the budget


def test_a_universe_over_the_budget_is_a_409_that_changes_nothing(world: StoreWorld, settings: Any) -> None:
    build(world, MODEL, ["a", "b"])  # the model's current universe: in use, never evicted
    pointer = current_pointer(world.ctx, MODEL)
    spec = spec_for(world, ["a", "c"])  # the universe that POST {"concepts": ["a", "c"]} asks for
    projected = project_universe(world.ctx, spec).total
    settings(universe_bytes_budget=held_now(world) + projected - 1, universe_retention_s=0)
    before = stored(world)
    with pytest.raises(UniverseBudgetExceeded) as refused:
        submit_universe(world.ctx, MODEL, ["a", "c"], None)
    problem = refused.value.to_problem().model_dump()
    assert problem["status"] == 409 and problem["type"].endswith("/universe-budget-exceeded")
    assert problem["projected_bytes"] == projected
    assert problem["budget_bytes"] == held_now(world) + projected - 1
    assert f"{projected} bytes" in problem["detail"] and "ENGRAM_UNIVERSE_BYTES_BUDGET" in problem["detail"]
    with pytest.raises(UniverseBudgetExceeded):  # a variant that would build it is refused the same way
        submit_variant(world.ctx, MODEL, {"a": -1.0}, 1.0, {**OPTIONS, "reference": ["c"]})
    assert stored(world) == before, "no job, no request, no current universe, no eviction"
    assert world.pending == []
    assert current_pointer(world.ctx, MODEL) == pointer
    settings(universe_bytes_budget=held_now(world) + projected)
    assert build(world, MODEL, ["a", "c"]) == spec.universe_id, "one byte more and it fits"


def test_a_variant_of_a_built_universe_needs_no_room(world: StoreWorld, settings: Any) -> None:
    uid = build(world, MODEL, ["a", "b"])
    settings(universe_bytes_budget=1)  # far below what is stored already
    view, job = submit_variant(world.ctx, MODEL, {"a": -1.0}, 1.0, {**OPTIONS, "universe": uid})
    assert job is not None
    [done] = world.run_pending()
    assert done.status == "succeeded", done
    assert view.universe_id == uid


# ---------------------------------------------------------------- retention


def test_unused_universes_are_evicted_least_recently_used_first(world: StoreWorld, settings: Any) -> None:
    ab, ac, ad, bc = (build(world, MODEL, names) for names in (["a", "b"], ["a", "c"], ["a", "d"], ["b", "c"]))
    current = build(world, MODEL, ["a", "b", "c", "d"])
    for uid, days in ((ac, 30), (ab, 20), (bc, 10), (ad, 3)):
        used_at(world, uid, days)
    spec = spec_for(world, ["c", "d"])
    projected = project_universe(world.ctx, spec).total
    # Room for the new universe once the two least recently used are gone, not one more.
    settings(
        universe_bytes_budget=held_now(world) - stored_bytes(world, ac) - stored_bytes(world, ab) + projected,
        universe_retention_s=2 * 86400,
    )
    new = build(world, MODEL, ["c", "d"])
    assert universe_view(world.ctx, ac).status == universe_view(world.ctx, ab).status == "evicted"
    assert [universe_view(world.ctx, u).status for u in (bc, ad, current, new)] == ["ready"] * 4
    assert held_now(world) <= world.ctx.settings.universe_bytes_budget


def test_universes_in_use_are_never_evicted(world: StoreWorld, settings: Any) -> None:
    recent = build(world, MODEL, ["b", "d"])  # used within the retention age
    busy = build(world, MODEL, ["a", "d"])  # a variant job not run yet reads it
    current = build(world, MODEL, ["a", "b", "c"])  # the model's current universe
    submit_variant(world.ctx, MODEL, {"d": -0.5}, 1.0, {**OPTIONS, "universe": busy})
    assert len(world.pending) == 1
    for uid in (current, busy):
        used_at(world, uid, 365)
    settings(universe_retention_s=86400)
    evicted = expire_unused(world.ctx)
    assert not {current, recent, busy} & set(evicted)
    assert {universe_view(world.ctx, u).status for u in (current, recent, busy)} == {"ready"}
    settings(universe_bytes_budget=held_now(world) + 1, universe_retention_s=86400)
    with pytest.raises(UniverseBudgetExceeded):  # nothing evictable is left to make room either
        submit_universe(world.ctx, MODEL, ["b", "c", "d"], None)
    assert {universe_view(world.ctx, u).status for u in (current, recent, busy)} == {"ready"}
    [done] = world.run_pending()  # the variant job finds its universe whole
    assert done.status == "succeeded", done


def test_an_evicted_universe_is_rebuilt_with_the_same_ids_and_bytes(world: StoreWorld, settings: Any) -> None:
    uid = build(world, MODEL, ["b", "c"])
    build(world, MODEL, ["a", "b", "c", "d"])  # another current universe
    before = world.ctx.storage.get_json(universe_prefix(uid) + "manifest.json")
    files = _part_digests(world, uid)
    first, _ = submit_variant(world.ctx, MODEL, {"b": -1.0}, 1.0, {**OPTIONS, "universe": uid})
    world.run_pending()
    variant_files = world.ctx.storage.get_json(f"variants/{first.variant_id}/manifest.json")["files"]
    used_at(world, uid, 30)
    settings(universe_retention_s=86400)
    assert uid in expire_unused(world.ctx)

    evicted = universe_view(world.ctx, uid)
    assert (evicted.status, evicted.bytes, evicted.groups.done) == ("evicted", 0, 0)
    assert evicted.evicted_at is not None
    assert world.ctx.storage.list(universe_prefix(uid)) == [universe_prefix(uid) + n for n in ("request.json", "usage.json")]
    assert find_usage(world.ctx, uid)["evicted_bytes"] == before["bytes"]["total"]

    again, job = submit_variant(world.ctx, MODEL, {"c": -1.0}, 1.0, {**OPTIONS, "universe": uid})
    assert job is not None and universe_view(world.ctx, uid).status == "building"
    world.run_pending()
    after = world.ctx.storage.get_json(universe_prefix(uid) + "manifest.json")
    assert after["universe_id"] == uid
    assert [m["key"] for m in after["members"]] == [m["key"] for m in before["members"]]
    assert after["groups"].keys() == before["groups"].keys() and after["layers"].keys() == before["layers"].keys()
    assert after["bytes"] == before["bytes"]
    assert _part_digests(world, uid) == files, "the same statistics and cut give the same factors and engrams"
    rebuilt, job = submit_variant(world.ctx, MODEL, {"b": -1.0}, 1.0, {**OPTIONS, "universe": uid})
    assert job is None and rebuilt.variant_id == first.variant_id, "the variant itself was kept"
    assert world.ctx.storage.get_json(f"variants/{first.variant_id}/manifest.json")["files"] == variant_files
    view = universe_view(world.ctx, uid)
    assert (view.status, view.evicted_at, view.bytes) == ("ready", None, before["bytes"]["total"])
    assert again.universe_id == uid


def test_another_process_never_reads_an_evicted_universe(world: StoreWorld, settings: Any) -> None:
    """A second process (its own read cache) that saw the universe built rebuilds it after another
    process evicted it, rather than reading parts that are gone."""
    uid = build(world, MODEL, ["a", "c", "d"])
    build(world, MODEL, ["a", "b", "c", "d"])
    other = Context(
        settings=world.ctx.settings, storage=world.ctx.storage, jobs=world.ctx.jobs, dispatch=None, lock=world.ctx.lock
    )
    assert universe_view(other, uid).status == "ready"
    assert ensure_universe(other, uid)[1] is True
    used_at(world, uid, 30)
    settings(universe_retention_s=86400)
    assert uid in expire_unused(world.ctx)
    manifest, existed = ensure_universe(other, uid)
    assert existed is False and manifest.universe_id == uid


def test_a_universe_built_before_usage_records_counts_from_its_request(world: StoreWorld, settings: Any) -> None:
    uid = build(world, MODEL, ["b", "d"])
    build(world, MODEL, ["a", "b", "c", "d"])
    world.ctx.storage.delete(usage_key(uid))
    request = world.ctx.storage.get_json(universe_prefix(uid) + "request.json")
    world.ctx.storage.put_json(universe_prefix(uid) + "request.json", {**request, "created_at": "2020-01-01T00:00:00+00:00"})
    settings(universe_retention_s=86400)
    assert uid in expire_unused(world.ctx)


# ---------------------------------------------------------------- metrics


def test_the_gauges_show_the_stored_bytes(world: StoreWorld, settings: Any) -> None:
    build(world, MODEL, ["a", "b"])
    settings(universe_bytes_budget=123 << 20)  # below any test volume: not capped
    retention.refresh_metrics(world.ctx)
    summary = retention.storage_summary(world.ctx)
    manifests = [world.ctx.storage.get_json(k) for k in world.ctx.storage.list("universes/") if k.endswith("/manifest.json")]
    assert summary.bytes.groups == sum(m["bytes"]["groups"] for m in manifests) > 0
    assert summary.bytes.engrams == sum(m["bytes"]["engrams"] for m in manifests) > 0
    assert REGISTRY.get_sample_value("engram_universe_bytes", {"part": "groups"}) == summary.bytes.groups
    assert REGISTRY.get_sample_value("engram_universe_bytes", {"part": "engrams"}) == summary.bytes.engrams
    assert REGISTRY.get_sample_value("engram_universe_budget_bytes") == 123 << 20
    assert REGISTRY.get_sample_value("engram_universes", {"status": "ready"}) == summary.universes.ready


def test_note_use_is_written_at_most_once_a_minute(world: StoreWorld) -> None:
    uid = build(world, MODEL, ["a", "b"])
    stamp = find_usage(world.ctx, uid)["last_used"]
    retention.note_use(world.ctx, uid)
    assert find_usage(world.ctx, uid)["last_used"] == stamp
    used_at(world, uid, 1)
    retention.note_use(world.ctx, uid)
    written = datetime.fromisoformat(find_usage(world.ctx, uid)["last_used"])
    assert abs((datetime.now(timezone.utc) - written).total_seconds()) < 60


def _part_digests(w: StoreWorld, universe_id: str) -> dict[str, Any]:
    """Each stored group or engram file's metadata and its tensors' SHA-256 (the header's key order
    is the safetensors library's hash order, which changes between writes of the same file)."""
    prefix = universe_prefix(universe_id)
    digests: dict[str, Any] = {}
    for key in w.ctx.storage.list(prefix):
        if key.endswith(".safetensors"):
            with safe_open(str(w.ctx.storage.local_path(key)), framework="pt") as handle:
                tensors = {k: hashlib.sha256(handle.get_tensor(k).numpy().tobytes()).hexdigest() for k in handle.keys()}
                digests[key] = (handle.metadata(), tensors)
    return digests


def test_asking_for_a_variant_again_counts_as_a_use(world: StoreWorld) -> None:
    uid = build(world, MODEL, ["a", "b"])
    first, _ = submit_variant(world.ctx, MODEL, {"a": -1.0}, 1.0, {**OPTIONS, "universe": uid})
    world.run_pending()
    used_at(world, uid, 30)
    again, job = submit_variant(world.ctx, MODEL, {"a": -1.0}, 1.0, {**OPTIONS, "universe": uid})
    assert job is None and again.variant_id == first.variant_id
    written = datetime.fromisoformat(find_usage(world.ctx, uid)["last_used"])
    assert abs((datetime.now(timezone.utc) - written).total_seconds()) < 60, "served from it: the retention clock restarts"
