"""What a request may say about why a resource is made: labels and a reason (and, for a variant, the
variant it reverts); what a resource's view says about who made it and when.

None of it is part of a resource's identity (the same edit is the same variant, the same records the
same concept, whoever asks and why): it is stored once, by the request that created the resource.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, field_validator

MAX_LABELS = 32
LABEL_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_LABEL_VALUE = 256
MAX_REASON = 2000
VARIANT_ID_PATTERN = r"^[A-Za-z0-9]{1,128}$"

LabelValue = Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE, pattern=r"^[^\x00-\x1f\x7f]*$")]


class MetadataFields(BaseModel):
    """Mixed into ``POST /models`` and ``POST /concepts`` (and, with ``reverts``, edit requests)."""

    labels: dict[str, LabelValue] | None = Field(
        default=None,
        max_length=MAX_LABELS,
        description=(
            f"key/value strings to find it by (its list's ?label=key:value): at most {MAX_LABELS}, "
            f"keys {LABEL_KEY_PATTERN}, values up to {MAX_LABEL_VALUE} printable characters"
        ),
    )
    reason: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_REASON,
        description="why it is made (a deletion request, a licence, a ticket); a variant's is kept in its receipt",
    )

    @field_validator("labels")
    @classmethod
    def _label_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        bad = [key for key in value or {} if not re.fullmatch(LABEL_KEY_PATTERN, key)]
        if bad:
            raise ValueError(f"label keys must match {LABEL_KEY_PATTERN}: {bad[:3]}")
        return value


class VariantMetadataFields(MetadataFields):
    """Mixed into ``unlearn`` and ``compose`` requests; never part of the variant ID."""

    reverts: str | None = Field(
        default=None,
        pattern=VARIANT_ID_PATTERN,
        description=(
            "the variant this request reverts (a compose adding back what it removed): a variant of the same "
            "model; its receipt points back to it"
        ),
    )


class CreationMetadata(BaseModel):
    """Who created a model or a concept, when and why, as its view shows it (null: stored before
    this was recorded)."""

    created_at: str | None = Field(default=None, description="when the request that created it was made (UTC, ISO 8601)")
    created_by: str | None = Field(
        default=None, description="the fingerprint of the key that created it (key-<12 hex>; anonymous without auth)"
    )
    labels: dict[str, str] = Field(default_factory=dict, description="the creating request's labels")
    reason: str | None = Field(default=None, description="the creating request's reason")
