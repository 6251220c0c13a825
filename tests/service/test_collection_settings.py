"""What enters a statistic's storage key: every setting that changes Σ, and nothing else."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.config import Settings
from service.registry import canonical_digest, collection_settings


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
