"""``DELETE /models/{id}``: what still depends on a model, and deleting it when nothing does.

The rules (docs/how-to/auth.md says them to users):

- Who: an admin key, or the write key whose request registered the model (its register job's owner).
- A 409 naming what depends on it, nothing deleted: a job not finished that names the model; a variant
  built from it (``DELETE /variants/{id}`` first: a variant is asked for by a key of its own); a concept whose
  statistics were collected on it (``DELETE /concepts/{name}`` first). Its universes and calibrations
  are named too, unless ``?cascade=true``: those exist only for this model, and a model's current
  universe cannot be deleted alone (``DELETE /universes/{id}`` refuses it), so the cascade deletes them
  with the model.
- What goes: what :func:`service.models.deletion.model_objects` names (registration, registration
  request, universe pointers) and, with the cascade, every object of its universes and calibrations.
  Nothing else: statistics stay with their concepts, a variant of another model is never read.
- Twice: the second DELETE is a 404 (RFC 9110 §9.3.5: the effect is idempotent, the answer need not
  be; a 404 tells a client that retried after a lost answer that the model is gone either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.api.auth import Principal
from service.api.dependents import still_needed
from service.calibration.deletion import model_calibrations, remove_calibration
from service.concepts.service import list_concepts
from service.context import Context
from service.errors import Conflict, Forbidden, NotFound
from service.models.deletion import model_owner, remove_model
from service.models.registry import find_model
from service.storage.keys import VARIANTS
from service.universes.records import model_universe_ids
from service.universes.retention import remove_universe
from service.variants.service import find_variant_request


@dataclass
class Dependents:
    """What still refers to a model, by kind."""

    jobs: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    concepts: list[str] = field(default_factory=list)
    universes: list[str] = field(default_factory=list)
    calibrations: list[str] = field(default_factory=list)

    def blocking(self, cascade: bool) -> dict[str, list[str]]:
        found = {"jobs": self.jobs, "variants": self.variants, "concepts": self.concepts}
        if not cascade:
            found |= {"universes": self.universes, "calibrations": self.calibrations}
        return {kind: ids for kind, ids in found.items() if ids}


def dependents(ctx: Context, model_id: str) -> Dependents:
    """Every job, variant, concept, universe and calibration that names ``model_id``, read from storage
    (never a cached view: the answer decides a deletion)."""
    jobs = [j.job_id for j in ctx.jobs.active() if getattr(j.payload, "model_id", None) == model_id]
    variants = [v for v in _variant_ids(ctx) if _request_model(ctx, v) == model_id]
    concepts = [c.name for c in list_concepts(ctx) if model_id in c.models]
    return Dependents(jobs, variants, concepts, model_universe_ids(ctx, model_id), model_calibrations(ctx, model_id))


def _variant_ids(ctx: Context) -> list[str]:
    """Every variant's ID, from a listing of storage itself: this decides a deletion, so no cached
    listing (``ctx.reads``) may hide a variant made a moment ago."""
    return sorted({k.split("/")[1] for k in ctx.storage.list(VARIANTS) if k.endswith("/request.json")})


def _request_model(ctx: Context, variant_id: str) -> str | None:
    request = find_variant_request(ctx, variant_id)  # read from storage, not the cache
    return None if request is None else request.model_id


def delete_model(ctx: Context, model_id: str, principal: Principal, *, cascade: bool) -> list[str]:
    """Delete the model (and, with ``cascade``, its universes and calibrations); the keys deleted.

    Raises:
        NotFound: not registered (never, or deleted already).
        Forbidden: a write key that did not register it.
        Conflict: something listed in the module's rules depends on it; nothing was deleted.
    """
    with ctx.lock:
        if find_model(ctx, model_id) is None:
            raise NotFound(f"model {model_id} is not registered (GET /models lists the registered models)")
        if principal.scope != "admin" and model_owner(ctx, model_id) != principal.key_id:
            raise Forbidden(f"model {model_id} was registered by another key: only it or an admin key may delete it")
        found = dependents(ctx, model_id)
        blocking = found.blocking(cascade)
        if blocking:
            raise Conflict(_refusal(model_id, blocking), extensions={"dependents": blocking})
        deleted = [key for cid in found.calibrations for key in remove_calibration(ctx, cid)] if cascade else []
        for universe_id in found.universes if cascade else ():
            remove_universe(ctx, universe_id)
        return deleted + remove_model(ctx, model_id)


_STEPS = {
    "jobs": "wait for the jobs or cancel them (DELETE /jobs/{id})",
    "variants": "delete those variants (DELETE /variants/{id})",
    "concepts": "delete those concepts (DELETE /concepts/{name})",
    "universes": "add ?cascade=true to delete its universes and calibrations with it",
    "calibrations": "add ?cascade=true to delete its universes and calibrations with it",
}


def _refusal(model_id: str, blocking: dict[str, list[str]]) -> str:
    return still_needed(f"model {model_id}", blocking, _STEPS)
