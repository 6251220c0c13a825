"""Which universe a request uses: the model's current universe, fixed by the first request or by
advancing it; explicit ``reference`` lists and ``universe`` IDs; and bad requests that change nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api_schemas import Variant
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.errors import Conflict, InvalidInput, NotFound
from service.jobs.records import JobRecord
from service.universes.records import current_pointer
from service.universes.service import list_universes, submit_universe, universe_view
from service.variants.service import submit_variant
from tests.helpers.store_world import StoreWorld, text_records

MODEL, OTHER_MODEL = "s/llama", "s/other"
OPTIONS = {"scaling": "uniform", "format": "checkpoint"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    root = tmp_path_factory.mktemp("variant-service")
    w = StoreWorld(root)
    tokenizer = make_tokenizer()
    w.register(MODEL, make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=tokenizer))
    w.register(OTHER_MODEL, make_tiny_llama(root / "models" / "other", hidden=32, layers=2, seed=1, tokenizer=tokenizer))
    w.publish(MODEL, "forget", text_records(0, 20))
    w.publish(MODEL, "retain", text_records(20, 60))
    w.publish(OTHER_MODEL, "forget", text_records(0, 20))
    return w


def unlearn(w: StoreWorld, model_id: str, names: list[str], **options: Any) -> tuple[Variant, JobRecord | None]:
    view, job = submit_variant(w.ctx, model_id, dict.fromkeys(names, -1.0), 1.0, {**OPTIONS, **options})
    w.run_pending()
    return view, job


def stored_files(w: StoreWorld) -> dict[str, int]:
    root = Path(w.ctx.storage.local_path(f"models/{MODEL.replace('/', '%2F')}.json")).parent.parent  # type: ignore[arg-type]
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_bad_requests_fix_no_universe(world: StoreWorld) -> None:
    before = stored_files(world)
    with pytest.raises(NotFound, match="ghost"):
        unlearn(world, MODEL, ["ghost"])
    with pytest.raises(InvalidInput, match="warp_proj"):
        unlearn(world, MODEL, ["forget"], modules=["warp_proj"])
    with pytest.raises(NotFound, match="0123456789abcdef0123456789abcdef"):
        unlearn(world, MODEL, ["forget"], universe="0123456789abcdef0123456789abcdef")
    assert current_pointer(world.ctx, MODEL) is None
    assert stored_files(world) == before


def test_the_same_request_keeps_its_variant_after_an_unrelated_upload(world: StoreWorld) -> None:
    first, job = unlearn(world, MODEL, ["forget"])
    assert job is not None
    pointer = current_pointer(world.ctx, MODEL)
    assert pointer is not None and sorted(pointer.members) == ["forget", "retain"], "every ready concept, then"
    assert first.universe_id == pointer.universe_id
    assert first.reference == ["forget", "retain"]
    world.publish(MODEL, "unrelated", text_records(0, 25, seed=9))
    again, job = unlearn(world, MODEL, ["forget"])
    assert job is None, "nothing to build: the same variant"
    assert again.variant_id == first.variant_id and again.status == "ready"
    assert current_pointer(world.ctx, MODEL) == pointer


def test_a_term_outside_the_current_universe_joins_it_for_that_request(world: StoreWorld) -> None:
    pointer = current_pointer(world.ctx, MODEL)
    assert pointer is not None
    variant, _ = unlearn(world, MODEL, ["unrelated"])
    assert variant.universe_id != pointer.universe_id
    assert variant.reference == ["forget", "retain"], "the answer names the current universe it extended"
    members = sorted(m.name for m in universe_view(world.ctx, variant.universe_id).members)
    assert members == ["forget", "retain", "unrelated"]
    again, job = unlearn(world, MODEL, ["unrelated"])
    assert (again.variant_id, job) == (variant.variant_id, None), "deterministic"
    assert current_pointer(world.ctx, MODEL) == pointer, "not advanced"


def test_advancing_the_universe_changes_the_answer(world: StoreWorld) -> None:
    before, _ = unlearn(world, MODEL, ["forget"])
    view, job = submit_universe(world.ctx, MODEL, None, None)
    assert sorted(m.name for m in view.members) == ["forget", "retain", "unrelated"]
    assert view.current is True
    assert job is None, "this universe was built by the variant that extended the old one"
    after, _ = unlearn(world, MODEL, ["forget"])
    assert after.universe_id == view.universe_id != before.universe_id
    assert after.variant_id != before.variant_id
    listed = list_universes(world.ctx, MODEL)
    assert [u.universe_id for u in listed if u.current] == [view.universe_id]
    assert {before.universe_id, after.universe_id} <= {u.universe_id for u in listed}
    assert all(u.status == "ready" for u in listed)


def test_an_explicit_universe_is_used_as_it_is(world: StoreWorld) -> None:
    old = next(u for u in list_universes(world.ctx, MODEL) if not u.current)
    names = sorted(m.name for m in old.members)
    terms = [names[0]]
    variant, _ = unlearn(world, MODEL, terms, universe=old.universe_id)
    assert variant.universe_id == old.universe_id and variant.status == "ready"
    assert variant.reference == names


@pytest.mark.parametrize(
    ("case", "error", "mention"),
    [
        ("other-model", Conflict, "s/other"),
        ("not-a-member", InvalidInput, "not in universe"),
        ("with-reference", InvalidInput, "either universe or reference"),
        ("other-rcond", InvalidInput, "rcond"),
    ],
)
def test_an_explicit_universe_that_does_not_fit_is_refused(
    world: StoreWorld, case: str, error: type[Exception], mention: str
) -> None:
    narrow = submit_universe(world.ctx, MODEL, ["forget"], None)[0]
    world.run_pending()
    other_model = submit_universe(world.ctx, OTHER_MODEL, None, None)[0]
    world.run_pending()
    submit_universe(world.ctx, MODEL, None, None)  # the wide one is current again
    before = stored_files(world)
    request: dict[str, Any] = {
        "other-model": {"names": ["forget"], "universe": other_model.universe_id},
        "not-a-member": {"names": ["retain"], "universe": narrow.universe_id},
        "with-reference": {"names": ["forget"], "universe": narrow.universe_id, "reference": ["forget"]},
        "other-rcond": {"names": ["forget"], "universe": narrow.universe_id, "rcond": 1e-3},
    }[case]
    names = request.pop("names")
    with pytest.raises(error, match=mention):
        unlearn(world, MODEL, names, **request)
    assert stored_files(world) == before


def test_another_rcond_is_another_universe(world: StoreWorld) -> None:
    plain, _ = unlearn(world, MODEL, ["forget"])
    cut, _ = unlearn(world, MODEL, ["forget"], rcond=1e-3)
    assert cut.universe_id != plain.universe_id and cut.rcond == 1e-3
    assert universe_view(world.ctx, cut.universe_id).rcond == 1e-3
    members = lambda uid: sorted(m.name for m in universe_view(world.ctx, uid).members)  # noqa: E731
    assert members(cut.universe_id) == members(plain.universe_id), "the current members, another cut"
