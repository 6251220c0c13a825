"""What a registered model owns in the store, who may delete it, and deleting it.

A model owns its registration (``models/<id>.json``), its registration request
(``registrations/<id>.json``) and its universe pointers (``model-universes/<id>/``). Nothing else is
its alone: statistics are addressed by the checkpoint's digest (two registrations of the same files
share them) and belong to the concepts that collected them; a downloaded checkpoint's local copy is
this machine's cache, not the store. What depends on it (variants, universes, concepts, calibrations,
jobs) is checked by the caller above this domain (``DELETE /models/{id}``), which owns those domains.
"""

from __future__ import annotations

from service.context import Context
from service.storage.keys import model_key, model_universes_prefix, registration_key


def model_owner(ctx: Context, model_id: str) -> str | None:
    """The key (fingerprint) whose request registered the model: its register job's owner; None when
    unknown (a registration made before owners were recorded, or by a job with none)."""
    pending = ctx.storage.find_json(registration_key(model_id))
    job_id = pending.get("job_id") if isinstance(pending, dict) else None
    job = ctx.jobs.get(job_id) if isinstance(job_id, str) else None
    return None if job is None else job.owner


def model_objects(ctx: Context, model_id: str) -> list[str]:
    """The keys the model owns, in deletion order: its registration last, so that an interrupted
    deletion leaves the model registered, and repeating the DELETE finishes it."""
    pointers = ctx.storage.list(model_universes_prefix(model_id))
    request = registration_key(model_id)
    return [*pointers, *([request] if ctx.storage.exists(request) else []), model_key(model_id)]


def remove_model(ctx: Context, model_id: str) -> list[str]:
    """Delete what the model owns (the caller checked that nothing depends on it). Returns the keys."""
    keys = model_objects(ctx, model_id)
    for key in keys:
        ctx.storage.delete(key)
    return keys
