"""``DELETE /concepts/{name}`` and ``DELETE /concepts/{name}/statistics``: what still needs a concept,
and deleting it (or only its statistics) when nothing does.

The rules (docs/how-to/auth.md says them to users):

- Who: an admin key, or the write key whose request created the concept (its record names the key;
  a concept stored before creators were recorded: admin only), as for variants and models.
- A 409 naming what depends on it, nothing deleted: a job not finished that collects it, or whose
  request names its statistics or a universe it is a member of (a universe build, a variant build, a
  calibration, a map); a stored variant of a universe it is a member of (the variant's request and
  plan name that universe: ``DELETE /variants/{id}`` first). A universe that includes it but that no
  stored variant needs does not block: it stays (universes are not the concept's; they have their
  own retention and DELETE), as does a model's current universe, which ``DELETE /models/{id}?cascade=true``
  deletes with its model. Such a universe keeps serving while its engrams are stored; evicted, it
  cannot be rebuilt without the concept.
- What goes: its record (``concepts/<name>.json``, last: an interrupted deletion leaves the concept,
  and repeating the DELETE finishes it), its statistics (``stats/<model>/<dataset>/<settings>/``,
  manifest first: they stop existing at once) and its dataset (``datasets/<sha256>.jsonl``). Both
  are content-addressed: a prefix or a dataset another concept names too (the same records posted
  under another name) is kept. Nothing else: its jobs' records are the job history, universes and
  variants are checked above.
- Statistics only: the statistics on every model (or ``model_id``'s), and the concept's collections
  on those models, are deleted; the concept and its dataset stay, so posting it again with those
  models collects them anew. The statistics are what a large model's concept weighs (a covariance per
  input group), the dataset is what it is made of.
- Twice: the second DELETE is a 404 (as ``DELETE /variants/{id}``: the effect is idempotent, the
  answer says nothing is left).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field

from service.api.auth import Principal
from service.api.dependents import still_needed
from service.concepts.record import ConceptRecord
from service.concepts.service import get_concept, list_concepts
from service.context import Context
from service.errors import Conflict, Forbidden, NotFound
from service.jobs.records import JobRecord
from service.statistics.key import manifest_key
from service.storage.keys import (
    VARIANTS,
    calibration_request_key,
    concept_key,
    dataset_key,
    map_request_key,
    variant_request_key,
)
from service.universes.records import find_request, known_universe_ids


@dataclass
class ConceptDependents:
    """What still needs a concept (or its statistics on some models), by kind."""

    jobs: list[JobRecord] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    universes: list[str] = field(default_factory=list)

    def blocking(self) -> dict[str, list[str]]:
        """Kind -> IDs (the 409's ``dependents``)."""
        found = {"jobs": [j.job_id for j in self.jobs], "variants": self.variants, "universes": self.universes}
        return {kind: ids for kind, ids in found.items() if ids}

    def named(self) -> dict[str, list[str]]:
        """Kind -> how the 409's detail names each (a job with its kind and state)."""
        jobs = [f"{job.kind} job {job.job_id} ({job.status})" for job in self.jobs]
        return {kind: jobs if kind == "jobs" else ids for kind, ids in self.blocking().items()}


def delete_concept(ctx: Context, name: str, principal: Principal) -> list[str]:
    """Delete the concept and every object it owns; the keys deleted.

    Raises:
        NotFound: no such concept (never posted, or deleted already).
        Forbidden: a write key that did not create it.
        Conflict: something listed in the module's rules needs it; nothing was deleted.
    """
    with ctx.lock:
        concept = _owned_concept(ctx, name, principal)
        _check_unneeded(ctx, concept, None)
        keys = [*_statistics_keys(ctx, concept, None), *_dataset_keys(ctx, concept), concept_key(name)]
        _delete(ctx, keys)
        return keys


def delete_statistics(ctx: Context, name: str, principal: Principal, model_id: str | None) -> list[str]:
    """Delete the concept's statistics on every model (``model_id``: on that one) and its collections
    there; the concept and its dataset stay. The keys deleted.

    Raises:
        NotFound: no such concept, or it has no collection on ``model_id``.
        Forbidden: a write key that did not create it.
        Conflict: something needs those statistics; nothing was deleted.
    """
    with ctx.lock:
        concept = _owned_concept(ctx, name, principal)
        if model_id is not None and model_id not in concept.models:
            held = ", ".join(sorted(concept.models)) or "none"
            raise NotFound(f"concept {name} has no statistics on model {model_id} (it has them on: {held})")
        models = {model_id} if model_id is not None else set(concept.models)
        _check_unneeded(ctx, concept, models)
        keys = _statistics_keys(ctx, concept, models)
        _delete(ctx, keys)
        kept = {m: entry for m, entry in concept.models.items() if m not in models}
        ctx.storage.put_json(concept_key(name), concept.model_copy(update={"models": kept}).to_json())
        ctx.reads.forget(concept_key(name))
        return keys


def _owned_concept(ctx: Context, name: str, principal: Principal) -> ConceptRecord:
    concept = get_concept(ctx, name)  # 404 naming close matches; read from storage, not the cache
    if principal.scope != "admin" and concept.created_by != principal.key_id:
        creator = concept.created_by or "no recorded key"
        raise Forbidden(
            f"concept {name} was created by {creator}, not by this key ({principal.key_id}): only the key that "
            "created a concept, or an admin key, may delete it or its statistics"
        )
    return concept


def _check_unneeded(ctx: Context, concept: ConceptRecord, models: Collection[str] | None) -> None:
    found = dependents(ctx, concept, models)
    if found.blocking():
        raise Conflict(_refusal(concept.name, found.named()), extensions={"dependents": found.blocking()})


def dependents(ctx: Context, concept: ConceptRecord, models: Collection[str] | None = None) -> ConceptDependents:
    """The unfinished jobs, stored variants and universes that need the concept (``models``: its
    statistics on those models), read from storage itself (the answer decides a deletion)."""
    universes = _universes_with(ctx, concept.name, models)
    needed = _variants_of(ctx, universes)
    needing = sorted({v for found in needed.values() for v in found})
    tokens = set(universes) | set(_own_prefixes(ctx, concept, models))
    jobs = _jobs_needing(ctx, concept, models, tokens)
    return ConceptDependents(jobs, needing, sorted(uid for uid, found in needed.items() if found))


def _universes_with(ctx: Context, name: str, models: Collection[str] | None) -> list[str]:
    """The universes the concept is a member of (on ``models`` when given)."""
    found = []
    for universe_id in sorted(known_universe_ids(ctx)):
        request = find_request(ctx, universe_id)
        if request is None or (models is not None and request.model_id not in models):
            continue
        if any(member.name == name for member in request.members):
            found.append(universe_id)
    return found


def _variants_of(ctx: Context, universes: Collection[str]) -> dict[str, list[str]]:
    """The stored variants whose request (and so plan) is of one of ``universes``, by universe; each
    variant's request read once, from storage itself."""
    found: dict[str, list[str]] = {uid: [] for uid in universes}
    if not universes:
        return found
    ids = sorted({k.split("/")[1] for k in ctx.storage.list(VARIANTS) if k.endswith("/request.json")})
    for variant_id in ids:
        universe_id = (ctx.storage.find_json(variant_request_key(variant_id)) or {}).get("universe_id")
        if universe_id in found:
            found[universe_id].append(variant_id)
    return found


def _jobs_needing(ctx: Context, concept: ConceptRecord, models: Collection[str] | None, tokens: set[str]) -> list[JobRecord]:
    """Unfinished jobs that collect the concept, or whose payload or stored request names one of
    ``tokens`` (universe IDs and statistics prefixes: digests, so a match is never a coincidence)."""
    found = []
    for job in ctx.jobs.unfinished():
        payload = job.payload.model_dump(mode="json")
        if job.kind == "collect":
            if payload.get("concept") == concept.name and (models is None or payload.get("model_id") in models):
                found.append(job)
            continue
        text = json.dumps(payload) + json.dumps(_stored_request(ctx, job, payload))
        if any(token in text for token in tokens):
            found.append(job)
    return found


def _stored_request(ctx: Context, job: JobRecord, payload: dict[str, object]) -> object:
    """What a job reads beside its payload: the request its kind stores (None for other kinds)."""
    keys = {"variant": ("variant_id", variant_request_key), "calibrate": ("calibration_id", calibration_request_key)}
    keys["map"] = ("map_id", map_request_key)
    if job.kind not in keys:
        return None
    name, key = keys[job.kind]
    return ctx.storage.find_json(key(str(payload.get(name))))


def _others(ctx: Context, name: str) -> list[ConceptRecord]:
    return [c for c in list_concepts(ctx) if c.name != name]


def _own_prefixes(ctx: Context, concept: ConceptRecord, models: Collection[str] | None) -> list[str]:
    """The concept's statistics prefixes (on ``models``) that no other concept names."""
    shared = {e.stats for other in _others(ctx, concept.name) for e in other.models.values() if e.stats}
    mine = (e.stats for m, e in concept.models.items() if e.stats and (models is None or m in models))
    return sorted({p for p in mine if p not in shared})


def _statistics_keys(ctx: Context, concept: ConceptRecord, models: Collection[str] | None) -> list[str]:
    """The keys of the concept's own statistics, each prefix's manifest first."""
    keys = []
    for prefix in _own_prefixes(ctx, concept, models):
        head = manifest_key(prefix)
        stored = ctx.storage.list(prefix)
        keys += [head] if head in stored else []
        keys += sorted(k for k in stored if k != head)
    return keys


def _dataset_keys(ctx: Context, concept: ConceptRecord) -> list[str]:
    """The concept's dataset when no other concept names the same records."""
    digest = concept.dataset_digest
    if digest is None or any(other.dataset_digest == digest for other in _others(ctx, concept.name)):
        return []
    return [dataset_key(digest)] if ctx.storage.exists(dataset_key(digest)) else []


def _delete(ctx: Context, keys: list[str]) -> None:
    for key in keys:
        ctx.storage.delete(key)
        ctx.reads.forget(key)


_STEPS = {
    "jobs": "wait for the jobs or cancel them (DELETE /jobs/{id})",
    "variants": "delete those variants (DELETE /variants/{id}): their universes include it",
    "universes": "delete those variants (DELETE /variants/{id}): their universes include it",
}


def _refusal(name: str, blocking: dict[str, list[str]]) -> str:
    return still_needed(f"concept {name}", blocking, _STEPS)
