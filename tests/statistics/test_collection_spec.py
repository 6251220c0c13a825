"""What enters a statistic's storage key: every setting that changes Σ, and nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from service.config import Settings
from service.statistics.spec import CollectionSpec
from service.storage.keys import canonical_digest


def collection_settings(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The stored form of a collection's settings (a job payload's, a manifest's ``settings``)."""
    return CollectionSpec.of(*args, **kwargs).dump()


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


# The settings digests of statistics published before CollectionSpec existed (the dicts
# service.concepts.statistics.collection_settings built), as canonical_digest gave them: a stored
# statistic keeps its key only while these stay byte-identical.
PUBLISHED = [
    ({"max_length": 512, "engine": "engram-service/1"}, "e5b27daf0ff8e8b9d37ad546d7c6201fcf09e5d4a04c224feb55c28a9e7521fa"),
    (
        {"max_length": 512, "engine": "engram-service/1", "stats_dtype": "float32"},
        "14fe7fd897c5bb7d5068001bd4d9e05c4e87ae1f592ec747e29359275dbe44fe",
    ),
    (
        {"max_length": 256, "engine": "engram-service/1", "collect_dtype": "bfloat16"},
        "a68e95031af950e837dedc750bc259b424beb5ac742ca941e2a678a35396e206",
    ),
    (
        {"max_length": 512, "engine": "engram-service/1", "modules": ["q_proj", "v_proj"], "template": "chat"},
        "cda9a98d78574160ff227a3209e4e40e5e2a8ab6557c11357a21ff2d66e4e703",
    ),
    (
        {
            "max_length": 512,
            "engine": "engram-service/1",
            "modules": ["dense"],
            "layers": "ab" * 32,
            "template": "chat",
            "stats_dtype": "float32",
            "collect_dtype": "float16",
        },
        "15b3ab9de392a5b02582b54ec8ad386f99cd457774ac8f7afafa52365cd5c80f",
    ),
]


@pytest.mark.parametrize(("stored", "digest"), PUBLISHED)
def test_a_stored_settings_dict_keeps_its_digest(stored: dict[str, Any], digest: str) -> None:
    spec = CollectionSpec.model_validate(stored)
    assert spec.dump() == stored, "the stored form round-trips: a job payload and a manifest read the same"
    assert spec.digest() == digest == canonical_digest(stored)


def test_the_spec_of_settings_gives_the_published_keys() -> None:
    assert CollectionSpec.of(Settings()).digest() == PUBLISHED[0][1]
    assert CollectionSpec.of(Settings(stats_dtype="float32")).digest() == PUBLISHED[1][1]
    assert CollectionSpec.of(Settings(max_length=256, collect_dtype="bfloat16")).digest() == PUBLISHED[2][1]
    assert CollectionSpec.of(Settings(), ["v_proj", "q_proj"], "chat").digest() == PUBLISHED[3][1]


def test_the_job_reads_typed_fields_with_their_defaults() -> None:
    plain = CollectionSpec.model_validate(PUBLISHED[0][0])
    assert (plain.max_length, plain.template, plain.module_list, plain.collect_dtype) == (512, None, None, None)
    assert plain.sums_dtype == "float64", "absent from the key: the default"
    full = CollectionSpec.model_validate(PUBLISHED[4][0])
    assert (full.module_list, full.template, full.sums_dtype, full.collect_dtype) == (
        ["dense"],
        "chat",
        "float32",
        "float16",
    )


def test_the_spec_is_frozen_and_names_its_fields() -> None:
    spec = CollectionSpec.of(Settings())
    with pytest.raises(ValidationError):
        spec.max_length = 4  # type: ignore[misc]
    with pytest.raises(ValidationError, match="max_lenght"):
        CollectionSpec.model_validate({"max_lenght": 512, "engine": "engram-service/1"})


def test_the_key_is_the_digests_and_the_spec() -> None:
    key = CollectionSpec.of(Settings()).key("m" * 64, "d" * 64)
    assert key.prefix == f"stats/{'m' * 64}/{'d' * 64}/{PUBLISHED[0][1]}/"
