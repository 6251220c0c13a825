"""Published statistics' manifest as a record: stored keys round-trip (older shapes too), a broken one is refused by name."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from service.statistics.key import manifest_key
from service.statistics.manifest import (
    MalformedStatistics,
    StatisticsManifest,
    publish_statistics,
    read_statistics_manifest,
    stats_manifest,
)
from tests.helpers.store_world import StoreWorld

PREFIX = "stats/d1/aa/s1/"


def collected(**changes: Any) -> dict[str, Any]:
    """A manifest as a collection job publishes it."""
    return {
        "tokens": 1234,
        "groups": 3,
        "layers": 7,
        "lacking": ["model.visual.proj"],
        "model_digest": "d1",
        "dataset_digest": "aa",
        "settings": {"max_length": 512, "modules": ["q_proj", "v_proj"], "sums_dtype": "float64"},
        "collection_seconds": 2.5,
        "truncation": {"records": 40, "truncated": None, "uncounted": None},
        "created_at": "2026-11-25T10:00:00Z",
        **changes,
    }


def without(stored: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in stored.items() if k not in keys}


@pytest.mark.parametrize(
    "stored",
    [
        collected(),
        without(collected(), "lacking", "truncation"),  # before lacking layers and max_length's report
        without(collected(), "truncation"),
        {"tokens": 40},  # published by hand (benchmarks, test worlds)
    ],
    ids=["collected", "oldest", "before truncation", "tokens only"],
)
def test_a_stored_manifest_round_trips_key_for_key(stored: dict[str, Any]) -> None:
    before = copy.deepcopy(stored)
    manifest = read_statistics_manifest(PREFIX, stored)
    assert manifest.to_json() == stored and stored == before
    assert manifest.tokens == stored["tokens"]
    assert manifest.lacking == (tuple(stored["lacking"]) if "lacking" in stored else None)
    assert manifest.truncation == stored.get("truncation")
    assert manifest.modules == (["q_proj", "v_proj"] if "settings" in stored else None)


def test_modules_are_none_when_collected_for_every_layer() -> None:
    manifest = read_statistics_manifest(PREFIX, collected(settings={"max_length": 512}))
    assert manifest.modules is None
    with pytest.raises(ValueError, match="frozen"):
        manifest.tokens = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("stored", "named"),
    [
        (without(collected(), "tokens"), "tokens: Field required"),
        (collected(lacking="model.visual.proj"), "lacking: Input should be a valid tuple"),
        (collected(checksum="x"), "checksum: Extra inputs are not permitted"),
    ],
    ids=["no tokens", "lacking a string", "unknown key"],
)
def test_a_broken_manifest_is_refused_by_name(stored: dict[str, Any], named: str) -> None:
    with pytest.raises(MalformedStatistics) as refused:
        read_statistics_manifest(PREFIX, stored)
    assert f"the manifest of the statistics at {PREFIX} cannot be read ({named}" in str(refused.value)
    assert refused.value.status == 503


def test_published_statistics_are_read_back_as_the_record(tmp_path: Path) -> None:
    world = StoreWorld(tmp_path)
    file = tmp_path / "statistics.safetensors"
    file.write_bytes(b"not read here")
    assert stats_manifest(world.ctx, PREFIX) is None
    published = read_statistics_manifest(PREFIX, collected())
    publish_statistics(world.ctx, PREFIX, file, lambda: published)
    assert world.ctx.storage.get_json(manifest_key(PREFIX)) == collected(), "the keys it always had"
    assert stats_manifest(world.ctx, PREFIX) == published
    assert isinstance(stats_manifest(world.ctx, PREFIX), StatisticsManifest)
