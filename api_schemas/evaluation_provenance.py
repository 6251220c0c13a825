"""Who asked for a stored evaluation, when and why, and which probes it scored.

An evaluation is identified by its variant and its stored probes (``evaluations/<id>.json``): the
same probes on the same variant are one evaluation, whoever asks and why. So its metadata, like a
variant's, is the first request's: written once with the result, never part of its ID. An
evaluation stored before this was recorded has none of these fields.

``probe_sets`` names each probe set scored by the sha256 of its probes as canonical JSON (keys
sorted, no spaces, non-ASCII escaped: ``json.dumps(probes, sort_keys=True, separators=(",", ":"))``
of the probes as stored, i.e. as sent without null fields) and its size, so evaluations of different
variants on the same probes can be lined up.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class ProbeSetDigest(BaseModel):
    """One probe set as scored."""

    sha256: str = Field(description="sha256 of the set's probes as canonical JSON (sorted keys, no spaces)")
    n: int = Field(description="probes in the set")


class EvaluationMetadata(BaseModel):
    """Mixed into an evaluation's result (absent in one stored before it was recorded)."""

    created_at: str | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="when the request that created the evaluation was made (UTC, ISO 8601)",
    )
    created_by: str | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="the fingerprint of the key that asked (key-<12 hex>; anonymous without auth)",
    )
    labels: dict[str, str] | None = Field(
        default=None, exclude_if=lambda v: v is None, description="the creating request's labels"
    )
    reason: str | None = Field(default=None, exclude_if=lambda v: v is None, description="the creating request's reason")
    probe_sets: dict[str, ProbeSetDigest] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="per probe set scored (forget, retain, test, holdout, utility.<name>; an empty set is absent): "
        "the sha256 of its probes as canonical JSON and its size: the same probes give the same digest",
    )
