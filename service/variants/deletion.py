"""Deleting a variant: every stored object it owns, and nothing another variant or its universe needs.

What a variant owns: ``variants/<id>/`` (its files, manifest, request, provenance), its plan
(``variant-plans/<id>.json``) and the evaluations run on it (``evaluations/<eid>.json`` and
``evaluations/<eid>.request.json``, told by the variant they name). Not owned, so kept: its universe
(other variants and future requests use it; universes have their own retention and DELETE), its
concepts and their statistics, and the probes an evaluation read (content-addressed, shared by any
evaluation of the same probes).

Refused with a 409 naming the job while an unfinished job builds the variant or reads it (an
evaluation, a generation, a calibration or map that names it), so that no job loses its input
half-way. The manifest goes first and the request last: a deletion interrupted half-way leaves a
variant that reads as failed, and a second DELETE finishes it. Once the request is gone a DELETE is a
404 (RFC 9110 §9.3.5: DELETE is idempotent in its effect on the server, not in its answer; a 404 tells
a client retrying after a lost answer that nothing is left, as ``DELETE /universes/{id}`` does).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from service.context import Context
from service.errors import Conflict, Forbidden, NotFound
from service.jobs.records import JobRecord
from service.storage.keys import VARIANTS, variant_manifest_key, variant_plan_key, variant_request_key
from service.variants.provenance import find_provenance

log = logging.getLogger("engram.variants")

EVALUATIONS = "evaluations/"


@dataclass(frozen=True)
class Deleter:
    """Who asks: the key's fingerprint, and whether it is an admin key (which may delete any variant)."""

    key_id: str
    admin: bool


def delete_variant(ctx: Context, variant_id: str, deleter: Deleter) -> list[str]:
    """Delete the variant and every object it owns.

    Returns:
        the storage keys deleted, in the order they were.

    Raises:
        NotFound: no such variant (never made, or deleted already).
        Forbidden: a write key that did not create it.
        Conflict: an unfinished job builds or reads it (named).
    """
    if not variant_id.isalnum() or not ctx.storage.exists(variant_request_key(variant_id)):
        raise NotFound(f"variant {variant_id} does not exist (never made, or deleted already)")
    _check_owner(ctx, variant_id, deleter)
    with ctx.lock:
        _check_unused(ctx, variant_id)
        keys = owned_keys(ctx, variant_id)
        for key in keys:
            ctx.storage.delete(key)
            ctx.reads.forget(key)
    log.info("variant %s deleted by %s: %d objects", variant_id, deleter.key_id, len(keys))
    return keys


def owned_keys(ctx: Context, variant_id: str) -> list[str]:
    """Every stored key the variant owns, manifest first and request last (see the module's docstring)."""
    first, last = variant_manifest_key(variant_id), variant_request_key(variant_id)
    folder = [k for k in ctx.storage.list(f"{VARIANTS}{variant_id}/") if k not in (first, last)]
    plan = [variant_plan_key(variant_id)] if ctx.storage.exists(variant_plan_key(variant_id)) else []
    head = [first] if ctx.storage.exists(first) else []
    return head + sorted(folder) + plan + evaluation_keys(ctx, variant_id) + [last]


def evaluation_keys(ctx: Context, variant_id: str) -> list[str]:
    """The keys of the evaluations run on the variant: each result names its variant; a request
    record (``<eid>.request.json``) names the job, whose payload names it."""
    found: list[str] = []
    for key in ctx.storage.list(EVALUATIONS):
        if key.endswith(".request.json"):
            stored = ctx.storage.find_json(key) or {}
            job = ctx.jobs.get(str(stored.get("job_id"))) if stored.get("job_id") else None
            if job is not None and getattr(job.payload, "variant_id", None) == variant_id:
                found.append(key)
        elif key.endswith(".json") and (ctx.storage.find_json(key) or {}).get("variant_id") == variant_id:
            found.append(key)
    return sorted(found)


def jobs_using(ctx: Context, variant_id: str) -> list[JobRecord]:
    """Unfinished jobs whose payload names the variant (builds it, evaluates it, generates with it,
    uses it as a retain model...): a variant ID is a content digest, so a match is never a coincidence."""
    return [job for job in ctx.jobs.unfinished() if variant_id in json.dumps(job.payload.model_dump(mode="json"))]


def _check_unused(ctx: Context, variant_id: str) -> None:
    using = jobs_using(ctx, variant_id)
    if using:
        named = ", ".join(f"{job.kind} job {job.job_id} ({job.status})" for job in using)
        raise Conflict(
            f"variant {variant_id} is in use by {named}: wait for it to finish or cancel it (DELETE /jobs/{{id}}), "
            "then delete the variant"
        )


def _check_owner(ctx: Context, variant_id: str, deleter: Deleter) -> None:
    """An admin key deletes any variant; a write key those it created (its provenance names the key)."""
    if deleter.admin:
        return
    record = find_provenance(ctx, variant_id)
    if record is None or record.created_by != deleter.key_id:
        creator = record.created_by if record is not None else "no recorded key"
        raise Forbidden(
            f"variant {variant_id} was created by {creator}, not by this key ({deleter.key_id}): "
            "only the key that created a variant, or an admin key, may delete it"
        )
