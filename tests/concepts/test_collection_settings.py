"""What enters a statistic's storage key: every setting that changes Σ, and nothing else."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.concepts.statistics import collection_settings
from service.config import Settings
from service.storage.keys import canonical_digest


def test_default_settings_keep_the_existing_statistics_keys() -> None:
    # Statistics collected before ENGRAM_STATS_DTYPE existed stay valid: the default adds no key.
    assert collection_settings(Settings()) == {"max_length": 512, "engine": "engram-service/1"}


def test_float32_storage_is_another_statistic() -> None:
    default, half = collection_settings(Settings()), collection_settings(Settings(stats_dtype="float32"))
    assert half["stats_dtype"] == "float32"
    assert canonical_digest(default) != canonical_digest(half)


def test_collect_dtype_is_another_statistic() -> None:
    half = collection_settings(Settings(collect_dtype="bfloat16"))
    assert half["collect_dtype"] == "bfloat16"
    assert canonical_digest(half) != canonical_digest(collection_settings(Settings()))


def test_batch_size_is_not_part_of_the_key() -> None:
    # Padding never changes a statistic, so the batch size must not split the cache.
    assert collection_settings(Settings(collect_batch_size=1)) == collection_settings(Settings(collect_batch_size=64))


def test_unknown_stats_dtype_is_refused() -> None:
    with pytest.raises(ValidationError):
        Settings(stats_dtype="bfloat16")


def test_modules_enter_the_key_only_when_given() -> None:
    """A concept posted with modules is another statistic; without them the key is the old one."""
    default = collection_settings(Settings())
    assert collection_settings(Settings(), None) == default
    some = collection_settings(Settings(), ["v_proj", "q_proj", "q_proj"])
    assert some["modules"] == ["q_proj", "v_proj"], "sorted, each suffix once"
    assert canonical_digest(some) != canonical_digest(default)
    assert canonical_digest(some) == canonical_digest(collection_settings(Settings(), ["q_proj", "v_proj"]))


def test_device_map_is_not_part_of_the_key() -> None:
    # Spreading the model over devices does not change Σ (tests/engine/test_device_map.py).
    assert collection_settings(Settings(device_map="auto")) == collection_settings(Settings())


@pytest.mark.parametrize(("value", "expected"), [("", "none"), ("none", "none"), ("auto", "auto"), ("AUTO", "auto")])
def test_device_map_values(value: str, expected: str) -> None:
    assert Settings(device_map=value).device_map == expected


def test_unknown_device_map_is_refused() -> None:
    with pytest.raises(ValidationError):
        Settings(device_map="balanced")
