"""Who asked for a variant, when and why: its provenance record (``variants/<id>/provenance.json``).

The variant ID names the edit only (:mod:`service.variants.spec`): two requests of the same edit are
one variant, whoever asks and why. So the metadata lives beside it, written once by the request that
created it. An identical later request is answered from storage with the first request's metadata
(its own labels and reason are not stored: the answer's ``warnings`` say so where the route passes
them on). A variant stored without a record (made before provenance) shows none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import ClassVar

from pydantic import Field

from api_schemas import Variant
from api_schemas.provenance import VariantMetadataFields
from service.context import Context
from service.errors import InvalidInput, NotFound
from service.jobs.admission import ANONYMOUS, job_owner
from service.metadata import MetadataFilter
from service.storage.keys import VARIANTS
from service.storage.records import FORMAT_VERSION, StoredRecord

PROVENANCE_FORMAT = FORMAT_VERSION


def provenance_key(variant_id: str) -> str:
    return f"{VARIANTS}{variant_id}/provenance.json"


class VariantProvenance(StoredRecord):
    """The stored record. ``created_by``: the key's fingerprint (``key-`` + 12 hex of its sha256),
    never the key."""

    record_name: ClassVar[str] = "variant provenance"

    format_version: int = PROVENANCE_FORMAT
    variant_id: str
    created_at: str
    created_by: str
    labels: dict[str, str] = Field(default_factory=dict)
    reason: str | None = None
    reverts: str | None = None

    def differs_from(self, meta: VariantMetadataFields) -> bool:
        """Whether a later request said something else than the stored record."""
        return (meta.labels or {}) != self.labels or meta.reason != self.reason or meta.reverts != self.reverts


def metadata_of(options: object) -> VariantMetadataFields:
    """The metadata a request carries (none for options without any, e.g. a calibration's variant)."""
    if isinstance(options, VariantMetadataFields):
        return VariantMetadataFields(labels=options.labels, reason=options.reason, reverts=options.reverts)
    return VariantMetadataFields()


def check_reverts(ctx: Context, meta: VariantMetadataFields, model_id: str) -> None:
    """``reverts`` names a variant of the same model (404 / 422 naming the fix, before anything is written)."""
    if meta.reverts is None:
        return
    stored = ctx.storage.find_json(f"{VARIANTS}{meta.reverts}/request.json")
    if stored is None:
        raise NotFound(f"reverts: variant {meta.reverts} does not exist: name the variant this request reverts")
    if stored.get("model_id") != model_id:
        raise InvalidInput(
            f"reverts: variant {meta.reverts} is of model {stored.get('model_id')}, not {model_id}: "
            "a revert is a variant of the same model"
        )


def find_provenance(ctx: Context, variant_id: str, *, recent: bool = False) -> VariantProvenance | None:
    """The stored record (None: a variant made before provenance, or none); ``recent``: as of at most
    a second ago (views only, never a write's input)."""
    if not variant_id.isalnum():
        return None
    key = provenance_key(variant_id)
    stored = ctx.reads.recent_json(key) if recent else ctx.storage.find_json(key)
    return None if stored is None else VariantProvenance.stored(key, stored)


def record_provenance(ctx: Context, variant_id: str, meta: VariantMetadataFields, *, create: bool) -> list[str]:
    """Store the record unless the variant has one (call under ``ctx.lock``).

    Args:
        create: the request builds the variant. False for one answered from storage: a variant made
            before provenance was recorded gets none, rather than naming a later requester its creator
            (who could then delete it).

    Returns:
        warnings: a note when the variant was created by an earlier request with other metadata.
    """
    found = find_provenance(ctx, variant_id)
    if found is None and not create:
        return []
    if found is None:
        record = VariantProvenance(
            variant_id=variant_id,
            created_at=now_iso(),
            created_by=job_owner.get() or ANONYMOUS,
            labels=dict(meta.labels or {}),
            reason=meta.reason,
            reverts=meta.reverts,
        )
        ctx.storage.put_json(provenance_key(variant_id), record.to_json())
        return []
    if found.differs_from(meta):
        return [
            f"variant {variant_id} was created by an earlier identical request ({found.created_at}, "
            f"{found.created_by}); its labels, reason and reverts are that request's: this request's were not stored"
        ]
    return []


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class VariantFilter:
    """What ``GET /variants`` narrows to: a concept among the terms, and the creation metadata
    (:class:`service.metadata.MetadataFilter`: labels, creator, time)."""

    concept: str | None = None
    meta: MetadataFilter = MetadataFilter()

    @classmethod
    def parse(
        cls,
        concept: str | None,
        labels: Sequence[str],
        created_after: str | None,
        created_before: str | None,
        created_by: str | None = None,
    ) -> VariantFilter:
        """The filter of the query's values (a 422 naming the parameter and the form it takes)."""
        return cls(concept, MetadataFilter.parse(labels, created_by, created_after, created_before))

    def admits(self, variant: Variant) -> bool:
        if self.concept is not None and self.concept not in variant.terms:
            return False
        return self.meta.admits(variant)
