"""What an evaluation's result records beside its scores: who asked, when and why, and which probes.

Written by the job (:func:`service.evaluation.run.run_evaluation`) with the result, from the job
record (``created_at``, ``owner``: the key's fingerprint), its payload (the request's labels and
reason) and the stored probes (each set's digest and size). None of it is the evaluation's identity
(its ID is the variant's and the stored probes' digest, :mod:`service.evaluation.service`), so a
result answered from storage keeps the first request's.
"""

from __future__ import annotations

from typing import Any

from api_schemas.evaluation_provenance import ProbeSetDigest
from service.evaluation.records import ProbeJson, StoredProbes
from service.jobs.admission import ANONYMOUS
from service.jobs.records import EvaluatePayload, JobRecord
from service.storage.keys import canonical_digest


def probe_sets(raw: StoredProbes) -> dict[str, list[ProbeJson]]:
    """Every non-empty probe set by name: forget, retain, test, holdout, ``utility.<name>``."""
    sets: dict[str, list[ProbeJson]] = {"forget": raw.forget, "retain": raw.retain, "test": raw.test or []}
    if raw.tofu is not None:
        sets["holdout"] = raw.tofu.holdout
        sets |= {f"utility.{name}": items for name, items in raw.tofu.utility.items()}
    return {name: items for name, items in sets.items() if items}


def probe_set_digests(raw: StoredProbes) -> dict[str, ProbeSetDigest]:
    """Per set the sha256 of its probes as canonical JSON (:func:`canonical_digest`) and its size."""
    return {name: ProbeSetDigest(sha256=canonical_digest(items), n=len(items)) for name, items in probe_sets(raw).items()}


def evaluation_metadata(job: JobRecord, raw: StoredProbes) -> dict[str, Any]:
    """The fields the result gains (:class:`api_schemas.evaluation_provenance.EvaluationMetadata`)."""
    payload = job.payload_of(EvaluatePayload)
    return {
        "created_at": job.created_at,
        "created_by": job.owner or ANONYMOUS,
        "labels": dict(payload.labels),
        "reason": payload.reason,
        "probe_sets": probe_set_digests(raw),
    }
