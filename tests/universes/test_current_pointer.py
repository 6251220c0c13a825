"""A model's current universe (``current.json``) as a record: its stored keys round-trip, a broken one is refused by name."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from service.storage.keys import current_pointer_key
from service.universes.records import (
    CurrentUniverse,
    MalformedPointer,
    current_pointer,
    current_universe_ids,
    read_current_pointer,
)
from service.universes.service import set_current
from service.universes.spec import Member, UniverseSpec
from tests.helpers.store_world import StoreWorld

KEY = current_pointer_key("m/one")


def stored_pointer(**changes: Any) -> dict[str, Any]:
    """A pointer as set_current stores it."""
    return {
        "universe_id": "a" * 32,
        "members": {"forget": "stats/d1/aa/s1/", "retain": "stats/d1/bb/s1/"},
        "rcond": None,
        "since": "2026-11-25T10:00:00Z",
        **changes,
    }


@pytest.mark.parametrize("stored", [stored_pointer(), stored_pointer(rcond=1e-6)], ids=["default cut", "cut"])
def test_a_stored_pointer_round_trips_key_for_key(stored: dict[str, Any]) -> None:
    before = copy.deepcopy(stored)
    pointer = read_current_pointer(KEY, stored)
    assert pointer.to_json() == stored and stored == before
    assert pointer.members["retain"] == "stats/d1/bb/s1/" and pointer.rcond == stored["rcond"]
    with pytest.raises(ValueError, match="frozen"):
        pointer.universe_id = "b" * 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("stored", "named"),
    [
        ({"universe_id": "a" * 32}, "members: Field required"),
        (stored_pointer(members=["forget"]), "members: Input should be a valid dictionary"),
        (stored_pointer(current=True), "current: Extra inputs are not permitted"),
    ],
    ids=["partial", "members a list", "unknown key"],
)
def test_a_broken_pointer_is_refused_by_name(stored: dict[str, Any], named: str) -> None:
    with pytest.raises(MalformedPointer) as refused:
        read_current_pointer(KEY, stored)
    assert f"the current universe {KEY} cannot be read ({named}" in str(refused.value)
    assert refused.value.status == 503


def test_set_current_stores_the_keys_it_always_had_and_moves_only_to_another_universe(tmp_path: Path) -> None:
    world = StoreWorld(tmp_path)
    members = (Member("forget", "stats/d1/aa/s1/", "aa"), Member("retain", "stats/d1/bb/s1/", "bb"))
    first, second = UniverseSpec("m/one", "d1", members, None), UniverseSpec("m/one", "d1", members[:1], 1e-6)
    assert current_pointer(world.ctx, "m/one") is None
    set_current(world.ctx, first)
    stored = world.ctx.storage.get_json(KEY)
    assert set(stored) == {"universe_id", "members", "rcond", "since"}
    assert stored["members"] == {"forget": "stats/d1/aa/s1/", "retain": "stats/d1/bb/s1/"} and stored["rcond"] is None
    pointer = current_pointer(world.ctx, "m/one")
    assert isinstance(pointer, CurrentUniverse) and pointer.to_json() == stored
    assert pointer.universe_id == first.universe_id
    set_current(world.ctx, first)  # the same universe again: the pointer (and its "since") stays
    assert current_pointer(world.ctx, "m/one") == pointer
    set_current(world.ctx, second)
    moved = current_pointer(world.ctx, "m/one")
    assert moved is not None and (moved.universe_id, moved.rcond) == (second.universe_id, 1e-6)
    assert current_universe_ids(world.ctx) == {second.universe_id}
