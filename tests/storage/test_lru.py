"""The byte-bounded LRU that keeps statistics and pseudo-inverse factors between jobs."""

from __future__ import annotations

from service.storage.lru import ByteLRU


def test_evicts_least_recently_used_beyond_the_budget() -> None:
    cache: ByteLRU[bytes] = ByteLRU(10, len)
    cache["a"], cache["b"] = b"1234", b"5678"
    assert cache["a"] == b"1234"  # now "b" is the least recently used
    cache["c"] = b"9999"
    assert set(cache) == {"a", "c"}
    assert cache.bytes == 8


def test_a_value_larger_than_the_budget_is_not_kept() -> None:
    cache: ByteLRU[bytes] = ByteLRU(3, len)
    cache["big"] = b"1234"
    assert "big" not in cache
    assert cache.bytes == 0


def test_replacing_a_key_counts_its_bytes_once() -> None:
    cache: ByteLRU[bytes] = ByteLRU(100, len)
    cache["a"] = b"12"
    cache["a"] = b"12345"
    assert cache.bytes == 5
    del cache["a"]
    assert len(cache) == 0
    assert cache.bytes == 0
