"""Memory-trace maps of a model: ρ by block and module type, as JSON or as a PNG heatmap.

A map is computed by a ``map`` job on a worker (it loads weights and decomposes ``Σ_U``); the route
answers from storage when the map exists, else waits up to ``?wait=`` seconds for its job: 200 with
the map when it finished, 202 with the job otherwise (poll ``Location``, then ask again).

A read key never starts work: it gets a stored map, or follows the job already computing it, and a
map nobody asked for yet is a 403 saying that a write key's request computes it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api_schemas import EngramMap, Job
from service.api.auth import may_start_work, request_principal
from service.api.deps import ContextDep, LanesDep
from service.api.job_answers import unfinished_answer, waited
from service.api.lanes import Lanes
from service.context import Context
from service.jobs.records import JobRecord
from service.maps import render
from service.maps.document import MapDocument
from service.maps.service import job_map, submit_map

router = APIRouter(tags=["models"])
ConceptsQuery = Annotated[list[str], Query(description="concept names, repeated or comma-separated")]
ReferenceQuery = Annotated[list[str] | None, Query(description="default: every concept ready on the model")]
RcondQuery = Annotated[float | None, Query(gt=0.0, lt=1.0, description="pseudo-inverse cut (default D·eps32)")]
PixelsQuery = Annotated[int | None, Query(ge=200, le=4000)]
MeasureQuery = Annotated[
    Literal["data", "weight"],
    Query(description="data: ‖W⁺X‖F / ‖WX‖F over the universe's inputs (0 to 1); weight: the paper's ‖W⁺‖F / ‖W‖F"),
]
MapWaitQuery = Annotated[
    float,
    Query(
        ge=0,
        le=60,
        description="when the map is not stored yet, wait up to this many seconds for its job: 200 with the map, else 202",
    ),
]
DEFAULT_WAIT_S = 30.0  # a small model's map takes seconds: most requests get the map itself

_COMPUTING: dict[int | str, dict[str, Any]] = {
    202: {"model": Job, "description": "the map's job is still running: poll the job (Location), then ask again"}
}
_PNG: dict[int | str, dict[str, Any]] = {200: {"content": {"image/png": {}}}, **_COMPUTING}


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


async def _map_or_job(
    request: Request,
    ctx: Context,
    lanes: Lanes,
    wait: float,
    model_id: str,
    concepts: list[str],
    reference: list[str] | None,
    rcond: float | None,
    measure: str,
) -> MapDocument | JSONResponse:
    """The map, or the answer to give while its job runs (202) or after it failed (its problem)."""
    may_start = may_start_work(request_principal(request))
    answer = await run_in_threadpool(
        submit_map, ctx, model_id, _split(concepts) or [], _split(reference), rcond, measure, may_start=may_start
    )
    if not isinstance(answer.outcome, JobRecord):
        return answer.outcome
    job = await waited(ctx, lanes, answer.outcome, wait)
    data = await run_in_threadpool(job_map, ctx, answer.request, job)
    return data if data is not None else unfinished_answer(job, "this map")


@router.get("/models/{model_id:path}/engram-map.png", response_class=Response, responses=_PNG)
async def engram_map_png(
    request: Request,
    model_id: str,
    ctx: ContextDep,
    lanes: LanesDep,
    concepts: ConceptsQuery,
    reference: ReferenceQuery = None,
    rcond: RcondQuery = None,
    width: PixelsQuery = None,
    height: PixelsQuery = None,
    measure: MeasureQuery = "data",
    wait: MapWaitQuery = DEFAULT_WAIT_S,
) -> Response:
    """The paper's Fig. 4 for these concepts: one heatmap per concept (blocks × module types, and the
    layers outside the blocks), each panel on its own colour scale (compare magnitudes by the colour
    bars and each panel's max). 202 with the job while it is computed."""
    data = await _map_or_job(request, ctx, lanes, wait, model_id, concepts, reference, rcond, measure)
    if isinstance(data, Response):
        return data
    default_width, default_height = render.default_size(data)
    png = await run_in_threadpool(render.render_png, data, width or default_width, height or default_height)
    return Response(png, media_type="image/png")


@router.get("/models/{model_id:path}/engram-map", response_model=EngramMap, responses=_COMPUTING)
async def engram_map_json(
    request: Request,
    model_id: str,
    ctx: ContextDep,
    lanes: LanesDep,
    concepts: ConceptsQuery,
    reference: ReferenceQuery = None,
    rcond: RcondQuery = None,
    measure: MeasureQuery = "data",
    wait: MapWaitQuery = DEFAULT_WAIT_S,
) -> Any:
    """Where each concept's engram lives, by block and module type: ``‖W_l⁺X‖_F / ‖W_l X‖_F`` over the
    universe's inputs (``measure=data``), or ``‖W_l⁺‖_F / ‖W_l‖_F`` (``measure=weight``). 202 with
    the job while it is computed."""
    return await _map_or_job(request, ctx, lanes, wait, model_id, concepts, reference, rcond, measure)
