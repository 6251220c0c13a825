"""The creation-metadata query parameters every list of created resources takes, read once.

``GET /models``, ``GET /concepts`` and ``GET /variants`` narrow by ``label=key:value`` (repeated:
every pair must match), ``created_by`` (a key's fingerprint) and ``created_after`` (inclusive) /
``created_before`` (exclusive), ISO 8601 (:class:`service.metadata.MetadataFilter`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query

from service.metadata import MetadataFilter

LabelQuery = Annotated[list[str] | None, Query(description="key:value; repeated: every pair must match")]
TimeQuery = Annotated[str | None, Query(description="ISO 8601 (UTC when no zone is given)")]
CreatorQuery = Annotated[
    str | None, Query(max_length=100, description="the fingerprint of the key that created it (key-<12 hex>)")
]


def metadata_filter(
    label: LabelQuery = None,
    created_by: CreatorQuery = None,
    created_after: TimeQuery = None,
    created_before: TimeQuery = None,
) -> MetadataFilter:
    """The filter of the request's query (a 422 naming a malformed parameter)."""
    return MetadataFilter.parse(label or [], created_by, created_after, created_before)


MetadataDep = Annotated[MetadataFilter, Depends(metadata_filter)]
