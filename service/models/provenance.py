"""Who registered a model, when and why: kept in its registration request (``registrations/<id>.json``).

The request that starts a model's ``register`` job writes that record (with the job's ID), so it is
where the registration's metadata lives: ``created_at``, ``created_by`` (the key's fingerprint, never
the key), and the ``labels`` and ``reason`` the request gave. An identical later request is answered
with the registration as it is and changes none of it; a registration made anew (the files changed)
is a new request, with its own. A record written before metadata was recorded shows ``created_at``
as the registration's time and ``created_by`` as its register job's owner where those are known, else
none (null).
"""

from __future__ import annotations

from typing import Any

from api_schemas.provenance import CreationMetadata, MetadataFields
from service.context import Context
from service.jobs.admission import ANONYMOUS, job_owner
from service.jobs.store import utc_now
from service.models.record import ModelRecord
from service.storage.keys import registration_key


def registration_request(model_id: str, source: str, job_id: str, meta: MetadataFields | None) -> dict[str, Any]:
    """The stored registration request of a new ``register`` job, with the request's metadata."""
    given = meta or MetadataFields()
    return {
        "model_id": model_id,
        "source": source,
        "job_id": job_id,
        "created_at": utc_now(),
        "created_by": job_owner.get() or ANONYMOUS,
        "labels": dict(given.labels or {}),
        "reason": given.reason,
    }


def model_metadata(ctx: Context, model: ModelRecord, *, recent: bool = True) -> CreationMetadata:
    """The registration's metadata (``recent``: read as of at most a second ago, for views)."""
    key = registration_key(model.model_id)
    stored = ctx.reads.recent_json(key) if recent else ctx.storage.find_json(key)
    record: dict[str, Any] = stored if isinstance(stored, dict) else {}
    created_by = record.get("created_by")
    if created_by is None and isinstance(record.get("job_id"), str):
        job = ctx.jobs.get(record["job_id"])
        created_by = None if job is None else job.owner
    labels = record.get("labels")
    return CreationMetadata(
        created_at=record.get("created_at") or model.registered_at,
        created_by=created_by,
        labels=labels if isinstance(labels, dict) else {},
        reason=record.get("reason") if isinstance(record.get("reason"), str) else None,
    )
