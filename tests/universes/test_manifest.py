"""The universe manifest as a record: read once through ``read_manifest``, stored with the keys it always had.

No universe is built here (test_universe_build checks a built one's manifest against the record);
the stored documents below are written by hand in the shape the build writes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from service.engrams.manifest import MalformedManifest, UniverseManifest, read_manifest
from service.storage.keys import universe_manifest_key
from service.universes.records import find_manifest
from tests.helpers.store_world import StoreWorld
from tests.helpers.universe_manifest import UID, stored_manifest


def test_a_stored_manifest_round_trips_with_its_keys() -> None:
    stored = stored_manifest()
    manifest = read_manifest(UID, stored)
    assert manifest.to_json() == stored, "the same keys and values, the group without an origin keeps none"
    assert manifest.member_prefixes == ["stats/a/b/c/", "stats/a/e/c/"]
    assert manifest.member_key("stats/a/e/c/") == "k1" and manifest.member_key("stats/x/") is None
    assert manifest.engram_norm("k1", "l0.k") == 0.5 and manifest.weight_norm("l0.o") == 0.5
    assert manifest.groups["g1"].source is None and manifest.bytes.total == 1752
    with pytest.raises(ValueError, match="frozen"):
        manifest.universe_id = "other"  # type: ignore[misc]


def test_the_record_written_is_what_is_read(tmp_path: Path) -> None:
    world = StoreWorld(tmp_path)
    world.ctx.storage.put_json(universe_manifest_key(UID), UniverseManifest.model_validate(stored_manifest()).to_json())
    assert world.ctx.storage.get_json(universe_manifest_key(UID)) == stored_manifest()
    for recent in (False, True):
        found = find_manifest(world.ctx, UID, recent=recent)
        assert found == read_manifest(UID, stored_manifest()), recent


def _broken(change: str) -> dict[str, Any]:
    data = copy.deepcopy(stored_manifest())
    if change == "format":
        data["format"] = "engram-universe/0"
    elif change == "missing":
        del data["engrams"]["k1"]["norms"]
    elif change == "extra":
        data["members"][0]["weights"] = 1
    elif change == "other universe":
        data["universe_id"] = "f" * 32
    return data


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("format", "format 'engram-universe/0', not 'engram-universe/1'"),
        ("missing", "engrams.k1.norms: Field required"),
        ("extra", "members.0.weights: Extra inputs"),
        ("other universe", "it names universe " + "f" * 32),
    ],
)
def test_a_malformed_manifest_is_refused_naming_the_universe(tmp_path: Path, change: str, why: str) -> None:
    world = StoreWorld(tmp_path)
    world.ctx.storage.put_json(universe_manifest_key(UID), _broken(change))
    with pytest.raises(MalformedManifest) as refused:
        find_manifest(world.ctx, UID)
    message = refused.value.detail
    assert f"universe {UID}" in message and why in message and f"DELETE /universes/{UID}" in message
    assert refused.value.status == 503
