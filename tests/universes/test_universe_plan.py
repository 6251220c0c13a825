"""A universe's ``plan.json`` as a record: its stored keys round-trip, a broken one is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.engine.layers import LayerSpec
from service.errors import ServiceUnavailable
from service.storage.keys import universe_plan_key
from service.universes.parts import UniversePlan
from service.universes.records import StoredPlan, find_plan, read_plan
from tests.helpers.store_world import StoreWorld

UNIVERSE = "c" * 32
Q, K, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"


def stored_plan() -> dict[str, Any]:
    return {"groups": {Q: [Q, K], DOWN: [DOWN]}, "layers": [Q, K, DOWN]}


def test_a_plan_is_stored_with_the_keys_it_always_had_and_read_back(tmp_path: Path) -> None:
    layers = [LayerSpec(name, 8, 8, False, False, 0) for name in (Q, K, DOWN)]
    plan = UniversePlan(layers, {Q: [Q, K], DOWN: [DOWN]}, {Q: {"stats/a/": Q}, DOWN: {"stats/a/": DOWN}})
    assert plan.stored().to_json() == stored_plan()
    world = StoreWorld(tmp_path)
    assert find_plan(world.ctx, UNIVERSE) is None
    world.ctx.storage.put_json(universe_plan_key(UNIVERSE), plan.stored().to_json())
    found = find_plan(world.ctx, UNIVERSE)
    assert found == read_plan(UNIVERSE, stored_plan()) == plan.stored()
    assert isinstance(found, StoredPlan) and len(found.groups) == 2 and found.groups[Q] == (Q, K)


@pytest.mark.parametrize(
    ("stored", "named"),
    [
        ({"layers": [Q]}, "groups: Field required"),
        ({**stored_plan(), "groups": [Q]}, "groups: Input should be a valid dictionary"),
        ({**stored_plan(), "members": {}}, "members: Extra inputs are not permitted"),
    ],
    ids=["no groups", "groups a list", "unknown key"],
)
def test_a_broken_plan_is_refused_by_name(stored: dict[str, Any], named: str) -> None:
    with pytest.raises(ServiceUnavailable) as refused:
        read_plan(UNIVERSE, stored)
    assert f"the plan of universe {UNIVERSE} cannot be read ({named}" in str(refused.value)
    assert f"DELETE /universes/{UNIVERSE}" in str(refused.value)
