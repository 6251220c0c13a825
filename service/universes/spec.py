"""What a universe is: its members' statistics, the model's weights and the cut (its ID hashes them).

Kept apart from :mod:`service.universes.service` (requests, views) so that the storage budget
(:mod:`service.universes.retention`), which the service calls, can read a spec without importing it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.models.record import ModelRecord
from service.statistics.key import StatsKey
from service.storage.keys import canonical_digest

UNIVERSE_FORMAT = "engram-universe/1"
# Its input groups' pseudo-inverse factors files (service.universes.factors writes them); named here,
# without torch, for the API's projection of a build's bytes (service.universes.projection).
FACTORS_FORMAT = "engram-factors/1"


@dataclass(frozen=True)
class Member:
    """A concept of a universe: its name when the universe was made, and its statistics."""

    name: str
    stats: str  # statistics prefix: stats/<model digest>/<dataset digest>/<settings digest>/
    dataset_digest: str


@dataclass(frozen=True)
class UniverseSpec:
    """Everything that determines a universe's factors and engrams (and so its ID)."""

    model_id: str
    model_digest: str
    members: tuple[Member, ...]  # sorted by name; two names may share one statistics prefix
    rcond: float | None

    @property
    def prefixes(self) -> list[str]:
        return sorted({m.stats for m in self.members})

    @property
    def names(self) -> list[str]:
        return sorted(m.name for m in self.members)

    def identity(self) -> dict[str, Any]:
        """What the ID hashes: names are labels, the statistics are the content."""
        return {
            "format": UNIVERSE_FORMAT,
            "model_digest": self.model_digest,
            "stats": self.prefixes,
            "settings": sorted({settings_digest(p) for p in self.prefixes}),
            "rcond": self.rcond,
        }

    @property
    def universe_id(self) -> str:
        return canonical_digest(self.identity())[:32]

    def to_json(self) -> dict[str, Any]:
        return {
            "universe_id": self.universe_id,
            "model_id": self.model_id,
            "model_digest": self.model_digest,
            "members": [{"name": m.name, "stats": m.stats, "dataset_digest": m.dataset_digest} for m in self.members],
            "stats": self.prefixes,
            "rcond": self.rcond,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UniverseSpec:
        members = tuple(Member(m["name"], m["stats"], m["dataset_digest"]) for m in data["members"])
        return cls(data["model_id"], data["model_digest"], members, data["rcond"])


def make_spec(model: ModelRecord, resolved: Mapping[str, Mapping[str, str]], rcond: float | None) -> UniverseSpec:
    """A universe of ``resolved`` (name -> {prefix, dataset_digest}, from ``ready_statistics``)."""
    members = tuple(Member(n, r["prefix"], r["dataset_digest"]) for n, r in sorted(resolved.items()))
    return UniverseSpec(model.model_id, model.digest, members, rcond)


def settings_digest(prefix: str) -> str:
    """The collection-settings digest of a statistics prefix (its last segment)."""
    return StatsKey.parse(prefix).settings_digest
