"""The one resolver of "the universe": which concepts an edit or a map is measured against.

Variants, calibrations and maps all ask here: given a model, the request's terms and what the
request says of its universe (a universe ID, a reference set, or nothing), which members, with
which statistics and which cut. Reads only; writes nothing (:func:`service.universes.service.set_current`
and :func:`~service.universes.service.record_universe` store what a request decided).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.concepts.service import default_reference, ready_statistics
from service.context import Context
from service.errors import Conflict, InvalidInput, NotFound
from service.models.record import ModelRecord
from service.statistics.key import StatsKey
from service.universes.records import current_pointer, find_request
from service.universes.spec import UniverseSpec, make_spec


@dataclass(frozen=True)
class EditUniverse:
    """The universe a request resolves to.

    Attributes:
        spec: the universe.
        terms: each term's statistics prefix.
        reference: the names shown as the request's ``reference`` (the reference set before the terms joined).
        becomes_current: the model had no current universe: this request makes ``reference`` current.
    """

    spec: UniverseSpec
    terms: dict[str, str]
    reference: list[str]
    becomes_current: UniverseSpec | None = None


def resolve_members(
    ctx: Context,
    model: ModelRecord,
    terms: Sequence[str],
    *,
    reference: Sequence[str] | None,
    universe_id: str | None = None,
    rcond: float | None = None,
    follow_current: bool = True,
) -> EditUniverse:
    """The universe of a request on ``model`` with these ``terms``; reads only, writes nothing.

    - ``universe_id``: that universe (404 unknown, 409 another model's, 422 a term not a member or
      another ``rcond``);
    - ``reference``: ``reference ∪ terms``;
    - neither: with ``follow_current`` (edits), the model's current universe ∪ terms, and a model
      without one gets every concept ready on it now (``becomes_current``); without it (maps,
      whose IDs were always made so), every concept ready on the model now ∪ terms.

    Raises:
        NotFound, Conflict, InvalidInput: as above; unknown or not-ready concepts name themselves.
    """
    model_id = model.model_id
    if universe_id is not None:
        if reference is not None:
            raise InvalidInput("give either universe or reference, not both")
        term_stats = ready_statistics(ctx, model_id, sorted(set(terms)))
        spec = _named_universe(ctx, model, universe_id, term_stats, rcond)
        return EditUniverse(spec, _prefixes(term_stats, terms), spec.names)
    if reference is not None or not follow_current:
        chosen = sorted(set(reference)) if reference is not None else default_reference(ctx, model_id)
        resolved = ready_statistics(ctx, model_id, sorted(set(chosen) | set(terms)))
        return EditUniverse(make_spec(model, resolved, rcond), _prefixes(resolved, terms), chosen)
    term_stats = ready_statistics(ctx, model_id, sorted(set(terms)))
    pointer = current_pointer(ctx, model_id)
    new_current = None
    if pointer is None:
        names = default_reference(ctx, model_id)
        new_current = make_spec(model, ready_statistics(ctx, model_id, names), None)
        current_members, current_rcond = {m.name: m.stats for m in new_current.members}, None
    else:
        current_members, current_rcond = pointer.members, pointer.rcond
    members = {n: {"prefix": p, "dataset_digest": StatsKey.parse(p).dataset_digest} for n, p in current_members.items()}
    held = {m["prefix"] for m in members.values()}
    members.update({n: r for n, r in term_stats.items() if r["prefix"] not in held})
    chosen_rcond = rcond if rcond is not None else current_rcond
    spec = make_spec(model, members, chosen_rcond)
    return EditUniverse(spec, _prefixes(term_stats, terms), sorted(current_members), new_current)


def _prefixes(resolved: Mapping[str, Mapping[str, str]], terms: Sequence[str]) -> dict[str, str]:
    return {n: resolved[n]["prefix"] for n in sorted(set(terms))}


def _named_universe(
    ctx: Context,
    model: ModelRecord,
    universe_id: str,
    term_stats: Mapping[str, Mapping[str, str]],
    rcond: float | None,
) -> UniverseSpec:
    request = find_request(ctx, universe_id)
    if request is None:
        raise NotFound(f"universe {universe_id} does not exist")
    spec = request.spec
    if spec.model_digest != model.digest:  # model IDs of the same weights share their universes
        raise Conflict(f"universe {universe_id} belongs to model {spec.model_id}, not {model.model_id}")
    outside = sorted(n for n, r in term_stats.items() if r["prefix"] not in spec.prefixes)
    if outside:
        raise InvalidInput(f"concept(s) not in universe {universe_id}: {', '.join(outside)}")
    if rcond is not None and rcond != spec.rcond:
        raise InvalidInput(f"universe {universe_id} has rcond {spec.rcond}; omit rcond or pass the same value")
    return spec
