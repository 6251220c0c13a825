"""``engram-service migrate``: every stored record rewritten once in the current format.

Readers accept only the current ``format_version`` (:mod:`service.models.stored`); data written by
0.1.0 is brought to it here, once, instead of through branches in every reader. Idempotent: a
record already current is left alone, so a second run changes nothing. What cannot be migrated
is refused by name (and left as it was), with what to do instead.

What changes:

- model registrations: the version only;
- concepts: the version only (:mod:`service.concepts.migrate`);
- universe requests: the version, and ``stats`` (the members' statistics) where 0.1.0 wrote none;
- variant requests: the options added since 0.1.0 get the value variants made before them had
  (no ``format``: ``checkpoint``; no ``lora_rank``, ``lora_target``, ``module_strengths``: none),
  and a request made before universes were stored gets its universe: the one of its statistics
  and cut, recorded (not built: a variant whose files are stored never needs it; one rebuilt
  builds it first);
- variant plans: a variant not built whose request has no plan beside it (requested before plans:
  :mod:`service.variants.plan`) gets the plan its submit would have made, so that its queued job
  runs; a built variant needs none (its job answers from the manifest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from service.concepts.migrate import concepts_of_any_version, migrate_concepts
from service.context import Context
from service.errors import NotFound, first_validation_error
from service.models.migrate import Migration, migrate_models, registration_of_any_version
from service.models.registry import get_model
from service.models.stored import FORMAT_VERSION, UnmigratedRecord
from service.statistics.key import StatsKey
from service.storage.keys import VARIANTS, universe_request_key, variant_manifest_key, variant_plan_key
from service.storage.stored_json import UnreadableRecord, find_record
from service.universes.records import find_request, known_universe_ids
from service.universes.service import record_universe
from service.universes.spec import Member, UniverseRequest, UniverseSpec
from service.variants.plan import plan_of_stored
from service.variants.spec import VariantRequest

# What variants stored before each option had (the options' defaults when they were added).
_OPTION_DEFAULTS: dict[str, Any] = {
    "alpha": None,
    "reference": [],
    "scaling": "uniform",
    "modules": None,
    "layers": None,
    "format": "checkpoint",
    "rcond": None,
    "lora_rank": None,
    "lora_target": None,
    "module_strengths": None,
    "universe_stats": [],
    "job_id": None,
}


class Unmigratable(Exception):
    """Why one record cannot be migrated, in words."""


def migrate_store(ctx: Context, *, dry_run: bool = False) -> Migration:
    """Migrate every record of ``ctx.storage``, lowest floor first (a variant's universe needs its
    model's registration in the current format). Run it with the service stopped."""
    done = migrate_models(ctx, dry_run=dry_run)
    done.extend(migrate_concepts(ctx, dry_run=dry_run))
    done.extend(migrate_universes(ctx, dry_run=dry_run))
    done.extend(migrate_variants(ctx, dry_run=dry_run))
    return done


def migrate_universes(ctx: Context, *, dry_run: bool = False) -> Migration:
    done = Migration()
    for universe_id in sorted(known_universe_ids(ctx)):  # every requested universe has its marker
        key = universe_request_key(universe_id)
        data = done.readable(ctx, key)
        if data is None or data.get("format_version") == FORMAT_VERSION:
            continue
        try:
            request = _universe_request(data)
        except ValidationError as exc:
            done.refused.append(
                (
                    key,
                    f"not a universe request ({first_validation_error(exc)}): "
                    "delete the universe (DELETE /universes/{id})",
                )
            )
            continue
        if not dry_run:
            ctx.storage.put_json(key, request.model_dump(mode="json"))
            ctx.reads.forget(key)
        done.changed.append((key, f"format_version {data.get('format_version')!r} -> {FORMAT_VERSION}"))
    return done


def _universe_request(data: Mapping[str, Any]) -> UniverseRequest:
    stats = data.get("stats")
    if stats is None:
        stats = sorted({m["stats"] for m in data.get("members") or () if isinstance(m, dict) and "stats" in m})
    return UniverseRequest.model_validate({**data, "stats": stats, "format_version": FORMAT_VERSION})


def migrate_variants(ctx: Context, *, dry_run: bool = False) -> Migration:
    done = Migration()
    for key in ctx.storage.list(VARIANTS):
        if not key.endswith("/request.json"):
            continue
        data = done.readable(ctx, key)
        if data is None:
            continue
        try:
            if data.get("format_version") == FORMAT_VERSION:
                _plan_current(ctx, done, key, data, dry_run)
                continue
            request, what = _migrated_request(ctx, data, dry_run)
            what += _write_plan(ctx, request, dry_run)  # before the request: a reader of a current one finds it
        except Unmigratable as exc:
            done.refused.append((key, str(exc)))
            continue
        if not dry_run:
            ctx.storage.put_json(key, request.model_dump(mode="json"))
        done.changed.append((key, what))
    return done


def _plan_current(ctx: Context, done: Migration, key: str, data: Mapping[str, Any], dry_run: bool) -> None:
    """A current request without its plan (stored before plans) gets it, reported under the plan's key
    (a malformed one is left to its readers, which refuse it by name)."""
    try:
        request = VariantRequest.stored(key, data)
    except ValidationError:
        return
    if ctx.storage.exists(variant_plan_key(request.variant_id)):
        return
    what = _write_plan(ctx, request, dry_run)
    if what:
        done.changed.append((variant_plan_key(request.variant_id), what.removeprefix("; ")))


def _write_plan(ctx: Context, request: VariantRequest, dry_run: bool) -> str:
    """Store the plan of a variant not built yet (``"; plan written ..."``; ``""`` when built).

    Raises:
        Unmigratable: its model is not registered, or its universe not recorded.
    """
    if ctx.storage.exists(variant_manifest_key(request.variant_id)):
        return ""
    if dry_run:  # a dry run records no universe: the plan of a request migrated here cannot be read yet
        return "; its plan written (the layers, terms and universe its job runs)"
    try:
        model = get_model(ctx, request.model_id)
        universe = find_request(ctx, request.universe_id)
    except (NotFound, UnmigratedRecord) as exc:  # a registration gone, or one this migration refused
        why = f"its plan cannot be made ({exc.detail}): fix that and migrate again, or delete the variant"
        raise Unmigratable(why) from None
    if universe is None:
        raise Unmigratable(f"its universe {request.universe_id} is not recorded: submit the request again")
    members = [(m.name, m.stats) for m in universe.members]
    plan = plan_of_stored(ctx, model, request, members, universe.spec.model_digest)
    ctx.storage.put_json(variant_plan_key(request.variant_id), plan.model_dump(mode="json"))
    return f"; its plan written ({len(plan.edited)} layer(s) edited, {len(plan.unreached)} unreached)"


def _migrated_request(ctx: Context, data: Mapping[str, Any], dry_run: bool) -> tuple[VariantRequest, str]:
    filled = {**_OPTION_DEFAULTS, **{k: v for k, v in data.items() if v is not None or k not in _OPTION_DEFAULTS}}
    filled["module_strengths"] = filled["module_strengths"] or None  # {} was read as "all 1", stored as None
    what = [f"format_version {data.get('format_version')!r} -> {FORMAT_VERSION}"]
    added = sorted(k for k in _OPTION_DEFAULTS if k not in data)
    if added:
        what.append(f"added {', '.join(added)} as variants before them had")
    if data.get("universe_id") is None:
        spec = _universe_of(ctx, filled)
        if not dry_run:
            with ctx.lock:
                record_universe(ctx, spec, None)
        filled["universe_id"] = spec.universe_id
        what.append(f"universe {spec.universe_id} (of its statistics and cut) recorded")
    try:
        request = VariantRequest.model_validate({**filled, "format_version": FORMAT_VERSION})
    except ValidationError as exc:
        raise Unmigratable(f"not a variant request ({first_validation_error(exc)})") from None
    return request, "; ".join(what)


def _universe_of(ctx: Context, data: Mapping[str, Any]) -> UniverseSpec:
    """The universe a request made before universes names by its statistics and cut.

    Raises:
        Unmigratable: its model is not registered, or was registered again with other weights, or
            a statistics prefix belongs to no concept on it (its name is the universe's label).
    """
    model_id = data.get("model_id")
    prefixes = sorted(set(data.get("universe_stats") or ()))
    if not model_id or not prefixes:
        raise Unmigratable("a request without a model or universe statistics: delete the variant")
    model = registration_of_any_version(ctx, model_id)
    if model is None:
        raise Unmigratable(f"its model {model_id} is not registered (or not readable): register it again, then migrate")
    foreign = [p for p in prefixes if StatsKey.parse(p).model_digest != model.digest]
    if foreign:
        raise Unmigratable(
            f"model {model_id} was registered again with other weights since (statistics {foreign[0]}): delete the variant"
        )
    names = _concept_names(ctx, model_id, data)
    nameless = [p for p in prefixes if p not in names]
    if nameless:
        raise Unmigratable(f"statistics {', '.join(nameless)} belong to no concept on model {model_id}: delete the variant")
    members = tuple(
        sorted((Member(n, p, StatsKey.parse(p).dataset_digest) for p in prefixes for n in names[p]), key=lambda m: m.name)
    )
    spec = UniverseSpec(model_id, model.digest, members, data.get("rcond"))
    key = universe_request_key(spec.universe_id)
    try:
        existing = find_record(ctx.storage, key)  # migrated or not (a dry run)
    except UnreadableRecord as exc:
        raise Unmigratable(f"its universe's request {key} cannot be read ({exc.why})") from None
    return spec if existing is None else _universe_request(existing).spec


def _concept_names(ctx: Context, model_id: str, data: Mapping[str, Any]) -> dict[str, list[str]]:
    """prefix -> the names it has: the request's terms, else the concepts collected with it."""
    names: dict[str, list[str]] = {}
    for name, prefix in (data.get("term_stats") or {}).items():
        names.setdefault(prefix, []).append(name)
    for concept in concepts_of_any_version(ctx):
        entry = concept.models.get(model_id)
        prefix = entry.stats if entry is not None else None
        if prefix and concept.name not in names.get(prefix, []) and (prefix not in names):
            names.setdefault(prefix, []).append(concept.name)
    return {p: sorted(set(n)) for p, n in names.items()}
