"""A statistics key: the one spelling of the prefix and file names that stored statistics live under."""

from __future__ import annotations

import pytest

from service.statistics.key import MANIFEST_FILE, STATISTICS_FILE, StatsKey, manifest_key, statistics_key

M, D, S = "a" * 64, "b" * 64, "c" * 64


def test_the_prefix_and_file_names_are_the_stored_ones() -> None:
    """Statistics published before StatsKey existed stay where readers look for them."""
    key = StatsKey(M, D, S)
    assert key.prefix == f"stats/{M}/{D}/{S}/"
    assert key.statistics == f"stats/{M}/{D}/{S}/statistics.safetensors"
    assert key.manifest == f"stats/{M}/{D}/{S}/manifest.json"
    assert (STATISTICS_FILE, MANIFEST_FILE) == ("statistics.safetensors", "manifest.json")
    assert statistics_key(key.prefix) == key.statistics and manifest_key(key.prefix) == key.manifest


@pytest.mark.parametrize("prefix", [f"stats/{M}/{D}/{S}/", f"stats/{M}/{D}/{S}"])
def test_a_prefix_parses_back_to_its_digests(prefix: str) -> None:
    key = StatsKey.parse(prefix)
    assert (key.model_digest, key.dataset_digest, key.settings_digest) == (M, D, S)
    assert key == StatsKey(M, D, S) and StatsKey.parse(key.prefix) == key


@pytest.mark.parametrize(
    "prefix", ["", "stats/", f"stats/{M}/{D}/", f"stats/{M}/{D}/{S}/x/", f"universes/{M}/{D}/{S}/", f"stats/{M}//{S}/"]
)
def test_what_is_not_a_statistics_prefix_is_refused_by_name(prefix: str) -> None:
    with pytest.raises(ValueError, match="statistics"):
        StatsKey.parse(prefix)


def test_a_digest_with_a_slash_is_refused() -> None:
    with pytest.raises(ValueError, match="dataset digest"):
        StatsKey(M, "b/c", S)
