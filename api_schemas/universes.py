"""Universes: the concepts an edit is relative to, their build and their storage."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from api_schemas.common import Strict
from api_schemas.jobs import Job


class UniverseCreate(Strict):
    concepts: list[str] | None = Field(
        default=None, min_length=1, max_length=256, description="default: every concept ready on the model"
    )
    rcond: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False, description="keep λ > rcond·λmax")
    callback_url: str | None = Field(
        default=None, max_length=2000, description="POSTed the build job when it ends (host must be allowlisted)"
    )


class UniverseMember(BaseModel):
    name: str
    dataset_digest: str


class UniverseGroups(BaseModel):
    done: int
    total: int | None = Field(default=None, description="known once the build has planned its input groups")


class UniverseBytes(BaseModel):
    groups: int = Field(description="the input groups' pseudo-inverse factors (float64)")
    engrams: int = Field(description="every member's engrams")
    total: int


class Universe(BaseModel):
    universe_id: str
    model_id: str
    members: list[UniverseMember]
    rcond: float | None = None
    current: bool = Field(description="requests without universe or reference use this universe")
    status: Literal["building", "ready", "partial", "failed", "evicted"] = Field(
        description="evicted: the retention rule deleted its factors and engrams; requesting it again rebuilds it. "
        "partial: the input groups of the layers requests edited are built, the others when a request needs them"
    )
    groups: UniverseGroups = Field(description="input groups whose pseudo-inverse is stored")
    bytes: int | None = Field(default=None, description="stored factors and engrams, once ready (0 once evicted)")
    bytes_detail: UniverseBytes | None = Field(default=None, description="once ready: bytes of the factors and engrams")
    projected_bytes: int | None = Field(
        default=None, description="what the build was projected to store when requested (checked against the budget)"
    )
    build_seconds: dict[str, float] | None = Field(
        default=None, description="once ready: decomposition, engrams and total seconds of the build"
    )
    job_id: str | None = None
    created_at: datetime | None = None
    last_used: datetime | None = Field(
        default=None, description="requested, built, or a variant requested from it (the retention rule's clock)"
    )
    evicted_at: datetime | None = Field(default=None, description="when the retention rule deleted it (status evicted)")


class UniverseStatusCounts(BaseModel):
    ready: int
    building: int
    partial: int = Field(default=0, description="built in part: the input groups requests needed so far")
    failed: int
    evicted: int


class UniverseKeyUsage(BaseModel):
    key: str = Field(description="an API key's identity (key- and 12 hex digits of its SHA-256; anonymous without auth)")
    bytes: int = Field(
        description="what this key is charged: the bytes of every universe it used within the retention age, "
        "a universe several keys used counted in full for each"
    )
    universes: int


class UniverseUsage(BaseModel):
    """What universes hold in storage against ``ENGRAM_UNIVERSE_BYTES_BUDGET``."""

    model_id: str | None = Field(default=None, description="the model these totals are of; null: every universe")
    budget_bytes: int = Field(
        description="the budget in force (0: no limit): ENGRAM_UNIVERSE_BYTES_BUDGET, capped for file:// storage to "
        "ENGRAM_UNIVERSE_VOLUME_FRACTION of the store's volume"
    )
    configured_budget_bytes: int | None = Field(default=None, description="ENGRAM_UNIVERSE_BYTES_BUDGET as configured")
    volume_bytes: int | None = Field(
        default=None, description="file:// storage: the store's volume (used + free bytes); null for s3"
    )
    budget_note: str | None = Field(
        default=None, description="why the budget in force differs from the configured one, or what was not checked"
    )
    key_share: float | None = Field(
        default=None, description="ENGRAM_UNIVERSE_KEY_SHARE: the fraction of the budget one API key may keep alive"
    )
    key_share_bytes: int | None = Field(default=None, description="key_share × budget_bytes")
    keys: list[UniverseKeyUsage] = Field(
        default_factory=list, description="per API key: the universes only it used within the retention age"
    )
    retention_s: float = Field(description="ENGRAM_UNIVERSE_RETENTION_S: unused this long, a universe may be evicted")
    bytes: UniverseBytes = Field(description="stored now: factors and engrams of every universe (partial builds too)")
    reserved_bytes: int = Field(description="projected bytes of builds still running beyond what they stored so far")
    evictable_bytes: int = Field(description="what the retention rule may delete now (universes nobody uses)")
    universes: UniverseStatusCounts


class UniverseSubmission(BaseModel):
    universe: Universe
    job: Job | None = None
