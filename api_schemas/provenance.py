"""What a request may say about why a variant is made: labels, a reason and the variant it reverts.

None of it is part of the variant's identity (the same edit is the same variant, whoever asks and
why): it is stored beside the variant, once, by the request that created it.
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


class VariantMetadataFields(BaseModel):
    """Mixed into ``unlearn`` and ``compose`` requests; never part of the variant ID."""

    labels: dict[str, LabelValue] | None = Field(
        default=None,
        max_length=MAX_LABELS,
        description=(
            f"key/value strings to find the variant by (GET /variants?label=key:value): at most {MAX_LABELS}, "
            f"keys {LABEL_KEY_PATTERN}, values up to {MAX_LABEL_VALUE} printable characters"
        ),
    )
    reason: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_REASON,
        description="why the edit is made (a deletion request, a licence, a ticket), kept in its receipt",
    )
    reverts: str | None = Field(
        default=None,
        pattern=VARIANT_ID_PATTERN,
        description=(
            "the variant this request reverts (a compose adding back what it removed): a variant of the same "
            "model; its receipt points back to it"
        ),
    )

    @field_validator("labels")
    @classmethod
    def _label_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        bad = [key for key in value or {} if not re.fullmatch(LABEL_KEY_PATTERN, key)]
        if bad:
            raise ValueError(f"label keys must match {LABEL_KEY_PATTERN}: {bad[:3]}")
        return value
