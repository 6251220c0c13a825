"""What a universe is: its members' statistics, the model's weights and the cut (its ID hashes them).

Kept apart from :mod:`service.universes.service` (requests, views) so that the storage budget
(:mod:`service.universes.retention`), which the service calls, can read a spec without importing it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from service.engrams.manifest import UNIVERSE_FORMAT
from service.models.record import ModelRecord
from service.models.stored import FORMAT_VERSION, check_format
from service.statistics.key import StatsKey
from service.storage.keys import canonical_digest

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


class UniverseMember(BaseModel):
    """A member as the universe's request stores it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    stats: str
    dataset_digest: str


class UniverseRequest(BaseModel):
    """What a universe is and which job builds it (``universes/<id>/request.json``): written when
    it is first asked for; only ``job_id`` changes after.

    Attributes:
        stats: the members' statistics prefixes, sorted, without duplicates.
        job_id: the job building it (None: none was needed, or not yet).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = FORMAT_VERSION
    universe_id: str
    model_id: str
    model_digest: str
    members: tuple[UniverseMember, ...]
    stats: tuple[str, ...]
    rcond: float | None
    job_id: str | None = None
    created_at: str | None = None

    @classmethod
    def of(cls, spec: UniverseSpec, job_id: str | None, created_at: str) -> UniverseRequest:
        members = tuple(UniverseMember(name=m.name, stats=m.stats, dataset_digest=m.dataset_digest) for m in spec.members)
        return cls(
            universe_id=spec.universe_id,
            model_id=spec.model_id,
            model_digest=spec.model_digest,
            members=members,
            stats=tuple(spec.prefixes),
            rcond=spec.rcond,
            job_id=job_id,
            created_at=created_at,
        )

    @classmethod
    def stored(cls, key: str, data: Mapping[str, Any]) -> UniverseRequest:
        """A stored request (refused by name when it is of an older format: ``engram-service migrate``)."""
        return cls.model_validate(check_format("universe request", key, data))

    @property
    def spec(self) -> UniverseSpec:
        members = tuple(Member(m.name, m.stats, m.dataset_digest) for m in self.members)
        return UniverseSpec(self.model_id, self.model_digest, members, self.rcond)


def make_spec(model: ModelRecord, resolved: Mapping[str, Mapping[str, str]], rcond: float | None) -> UniverseSpec:
    """A universe of ``resolved`` (name -> {prefix, dataset_digest}, from ``ready_statistics``)."""
    members = tuple(Member(n, r["prefix"], r["dataset_digest"]) for n, r in sorted(resolved.items()))
    return UniverseSpec(model.model_id, model.digest, members, rcond)


def settings_digest(prefix: str) -> str:
    """The collection-settings digest of a statistics prefix (its last segment)."""
    return StatsKey.parse(prefix).settings_digest
