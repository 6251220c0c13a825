"""A universe manifest as the build stores it: the one tests/universes/test_manifest.py pins and the
stored-record byte tests write (tests/storage/stored_record_fixtures.py)."""

from __future__ import annotations

from typing import Any

UID = "0123456789abcdef0123456789abcdef"


def stored_manifest() -> dict[str, Any]:
    """A manifest as the build stores it: one group with its part record's origin, one without (a
    group published before part records were kept), ``rcond`` null."""
    return {
        "format": "engram-universe/1",
        "universe_id": UID,
        "model_id": "m/llama",
        "model_digest": "d" * 64,
        "rcond": None,
        "members": [
            {"names": ["forget"], "stats": "stats/a/b/c/", "dataset_digest": "b", "key": "k0", "tokens": 12},
            {"names": ["other", "retain"], "stats": "stats/a/e/c/", "dataset_digest": "e", "key": "k1", "tokens": 30},
        ],
        "groups": {
            "g0": {
                "layers": ["l0.q", "l0.k"],
                "dim": 8,
                "rank": 7,
                "explicit": False,
                "bytes": 640,
                "source": "rows",
                "worker": "host:1",
                "seconds": 0.25,
            },
            "g1": {"layers": ["l0.o"], "dim": 8, "rank": 8, "explicit": True, "bytes": 512},
        },
        "layers": {
            "l0.q": {"group": "g0", "dtype": "F32", "weight_norm": 1.5},
            "l0.k": {"group": "g0", "dtype": "F32", "weight_norm": 2.0},
            "l0.o": {"group": "g1", "dtype": "F32", "weight_norm": 0.5},
        },
        "engrams": {
            "k0": {"bytes": 300, "norms": {"l0.q": 0.1, "l0.k": 0.2, "l0.o": 0.3}},
            "k1": {"bytes": 300, "norms": {"l0.q": 0.4, "l0.k": 0.5, "l0.o": 0.6}},
        },
        "bytes": {"groups": 1152, "engrams": 600, "total": 1752},
        "seconds": {"groups": 0.5, "engrams": 1.25},
        "created_at": "2026-11-26T22:00:00Z",
    }
