"""Asking for a memory-trace map: checked and answered in the request when stored, else a ``map`` job.

The API process reads records only (the model, the concepts, the universe they resolve to): the map
itself loads weights and decomposes ``Σ_U`` (:mod:`service.maps.build`), a worker's work. A request
whose map is stored is answered at once; one whose map is being computed follows that job; any
other starts one (the map's ID, its content address, names it: the same request twice starts one job),
unless it comes with a read key, which never starts work (:class:`MapNotComputed`), or its key has
too many jobs queued already (:func:`service.jobs.admission.admit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from service.context import Context
from service.errors import Forbidden, InvalidInput
from service.jobs.admission import admit
from service.jobs.records import JobRecord, MapPayload
from service.jobs.store import new_job
from service.maps.document import MapDocument
from service.models.registry import get_model
from service.storage.keys import canonical_digest, map_key, map_request_key
from service.universes.members import resolve_members

MAX_CONCEPTS = 8
MEASURES = ("data", "weight")


@dataclass(frozen=True)
class MapRequest:
    """Everything that determines a map, resolved: what the ``map`` job reads (``maps/<id>.request.json``).

    Attributes:
        map_id: the digest of the model's content, the concepts' statistics, the universe, the cut
            and the measure: the map's content address.
        concepts: the concepts drawn, in request order.
        universe_names: every concept of the universe (the concepts and their reference).
        stats: each drawn concept's statistics prefix.
        prefixes: the universe's statistics prefixes.
    """

    map_id: str
    model_id: str
    concepts: tuple[str, ...]
    universe_names: tuple[str, ...]
    stats: Mapping[str, str]
    prefixes: tuple[str, ...]
    rcond: float | None
    measure: str

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stats": dict(self.stats)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MapRequest:
        return cls(
            map_id=data["map_id"],
            model_id=data["model_id"],
            concepts=tuple(data["concepts"]),
            universe_names=tuple(data["universe_names"]),
            stats=dict(data["stats"]),
            prefixes=tuple(data["prefixes"]),
            rcond=data["rcond"],
            measure=data["measure"],
        )


def map_request(
    ctx: Context,
    model_id: str,
    concepts: Sequence[str],
    reference: Sequence[str] | None,
    rcond: float | None,
    measure: str = "data",
) -> MapRequest:
    """Check a map request and resolve it to its content address (reads records only: no weights,
    no statistics, no linear algebra, so the API answers it in the request).

    Raises:
        InvalidInput: no concept, too many, or an unknown measure.
        NotFound, Conflict: the model or a concept is unknown, or a concept is not ready on the model.
    """
    names = list(dict.fromkeys(concepts))
    if not names:
        raise InvalidInput("name at least one concept: ?concepts=a,b")
    if len(names) > MAX_CONCEPTS:
        raise InvalidInput(f"at most {MAX_CONCEPTS} concepts per map, got {len(names)}")
    if measure not in MEASURES:
        raise InvalidInput(f"measure must be one of {', '.join(MEASURES)}, got {measure!r}")
    model = get_model(ctx, model_id)
    # Every concept ready on the model ∪ the drawn ones, without reference: maps were always so named.
    universe = resolve_members(ctx, model, names, reference=reference, rcond=rcond, follow_current=False)
    stats = {n: universe.terms[n] for n in names}
    identity = {"model": model.digest, "concepts": stats, "rcond": rcond}
    if measure != "weight":  # the weight-norm maps keep the keys they were stored under
        identity["measure"] = measure
    map_id = canonical_digest({**identity, "universe": universe.spec.prefixes})
    return MapRequest(
        map_id,
        model_id,
        tuple(names),
        tuple(universe.spec.names),
        stats,
        tuple(universe.spec.prefixes),
        rcond,
        measure,
    )


def find_map(ctx: Context, request: MapRequest) -> MapDocument | None:
    """The stored map answering ``request``, or None when it was not computed yet."""
    cached = ctx.storage.find_json(map_key(request.map_id))
    if cached is None:
        return None
    # The document the map job stored (build.compute_map), read back as the JSON it wrote.
    return cast(MapDocument, {**cached, "model_id": request.model_id, "measure": request.measure})


class MapNotComputed(Forbidden):
    """A read key asked for a map that no one computed yet: computing it is work, which read keys never start."""

    headers = {"WWW-Authenticate": 'Bearer realm="engram-service", error="insufficient_scope", scope="write"'}

    def __init__(self, request: MapRequest) -> None:
        super().__init__(
            f"the engram map of {', '.join(request.concepts)} on model {request.model_id} with these options "
            f"(rcond={request.rcond}, measure={request.measure}) is not computed yet, and a read key never starts "
            "work: make this same request once with a write or admin key (it computes the map), then any key reads it"
        )


@dataclass(frozen=True)
class MapAnswer:
    """A map request's answer: the map when it is stored, else the job computing it."""

    request: MapRequest
    outcome: MapDocument | JobRecord


def submit_map(
    ctx: Context,
    model_id: str,
    concepts: Sequence[str],
    reference: Sequence[str] | None,
    rcond: float | None,
    measure: str = "data",
    *,
    may_start: bool = True,
) -> MapAnswer:
    """The stored map, or the job that computes it (started here unless one is queued or running).

    Args:
        may_start: whether the caller may start the job (False for a read key).

    Raises:
        MapNotComputed: ``may_start`` is False and neither the map nor a job computing it exists.
        TooManyJobs: starting the job would exceed a bound on queued jobs.
    """
    request = map_request(ctx, model_id, concepts, reference, rcond, measure)
    data = find_map(ctx, request)
    if data is not None:
        return MapAnswer(request, data)
    with ctx.lock:
        stored = ctx.storage.find_json(map_request_key(request.map_id))
        job = ctx.jobs.get(stored["job_id"]) if stored and stored.get("job_id") else None
        if job is not None and job.status in {"queued", "running"}:
            return MapAnswer(request, job)
        if job is not None and job.status == "succeeded":  # finished since find_map looked
            data = find_map(ctx, request)
            if data is not None:
                return MapAnswer(request, data)
        if not may_start:
            raise MapNotComputed(request)
        admit(ctx)
        payload = MapPayload(map_id=request.map_id, model_id=model_id)
        job = ctx.jobs.create(new_job("map", payload, unit="layers"))
        ctx.storage.put_json(map_request_key(request.map_id), {**request.to_json(), "job_id": job.job_id})
    ctx.dispatch(job)
    return MapAnswer(request, ctx.jobs.get(job.job_id) or job)


def job_map(ctx: Context, request: MapRequest, job: JobRecord) -> MapDocument | None:
    """The map once ``job`` succeeded (None while it runs, or when it failed)."""
    return find_map(ctx, request) if job.status == "succeeded" else None
