"""Calibration: search α, scaling, module sets and layers on probes; its result and its front as a PNG."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from api_schemas import CalibrateRequest, Calibration, CalibrationSubmission
from api_schemas.calibration_list import CalibrationSummary
from service.api.deps import ContextDep, LanesDep
from service.api.pagination import PAGED_HEADERS, Page, PageDep, SortKey
from service.api.routes.jobs import job_view
from service.calibration import listing
from service.calibration import service as calibration
from service.calibration.deletion import delete_calibration as delete_calibration_records
from service.context import Context

router = APIRouter(tags=["calibration"])
_PNG: dict[int | str, dict[str, Any]] = {
    200: {"content": {"image/png": {}}, "description": "The front: forget vs retain NLL ratio of every candidate"}
}


@router.post("/models/{model_id:path}/calibrate", response_model=CalibrationSubmission, status_code=202)
def calibrate(model_id: str, body: CalibrateRequest, ctx: ContextDep, response: Response) -> CalibrationSubmission:
    """Find the strongest unlearning of ``concepts`` whose retain NLL ratio meets the constraint; or,
    with ``objective``, the best value of a named score (TOFU's ``overall``, ``privacy`` …, as
    ``evaluate`` reports them) within ``constraints`` (``min``/``max``, or relative to the base
    model's value), checked on ``held_out_fraction`` of the probes it was not chosen on.

    A job (kind ``calibrate``, progress in candidates) evaluates candidates (α × scaling × module set
    × layer set) on the probes within ``budget``, and builds the recommended one as a variant in
    ``format``. Its ``result``: every candidate, the Pareto front, ``recommended`` and ``front_png``.
    The same request gives the same answer: 200 with the finished job once it exists.
    """
    calibration_id, job, finished = calibration.submit_calibration(ctx, model_id, body)
    response.status_code = 200 if finished else 202
    return CalibrationSubmission(calibration_id=calibration_id, job=job_view(job))


_LIST_ANSWERS: dict[int | str, dict[str, Any]] = {
    **PAGED_HEADERS,
    404: {"description": "`model_id` names a model that is not registered"},
}


@router.get("/calibrations", response_model=list[CalibrationSummary], responses=_LIST_ANSWERS)
async def list_calibrations(
    ctx: ContextDep,
    lanes: LanesDep,
    page: PageDep,
    model_id: Annotated[str | None, Query(max_length=256, description="only this model's (404: not registered)")] = None,
) -> list[CalibrationSummary]:
    """Calibrations by ID, each with its model, concepts, status and creation time and, once it
    succeeded, its candidates' count and its recommendation's headline (options, NLL ratios, exact
    match, variant): one page (``limit``, ``cursor``). The whole result is ``GET /calibrations/{id}``."""
    return page.answer(*await lanes.status(_calibrations_page, ctx, page, model_id))


def _calibrations_page(ctx: Context, page: Page, model_id: str | None) -> tuple[list[CalibrationSummary], SortKey | None]:
    """Only the page's calibrations (and one more, and those of other models) are read."""
    ids = listing.calibration_ids(ctx, model_id)
    return page.select(((i,) for i in ids), lambda key: listing.calibration_summary(ctx, key[0], model_id))


@router.get("/calibrations/{calibration_id}", response_model=Calibration)
async def get_calibration(calibration_id: str, ctx: ContextDep, lanes: LanesDep) -> Calibration:
    """A calibration: its status and, once its job succeeded, its result."""
    return await lanes.status(calibration.calibration_view, ctx, calibration_id)


_METRIC = Query(max_length=64, description="a metric the candidates carry (default: the NLL ratios)")


@router.get("/calibrations/{calibration_id}/front.png", response_class=Response, responses=_PNG)
async def get_front_png(
    calibration_id: str,
    ctx: ContextDep,
    lanes: LanesDep,
    x: Annotated[str | None, _METRIC] = None,
    y: Annotated[str | None, _METRIC] = None,
) -> Response:
    """The calibration's front drawn when its job finished (the recommended candidate starred): by
    default retain (x) against forget (y) NLL ratio; ``x`` and ``y`` name any two metrics its
    candidates carry (with an objective, TOFU's), a 422 naming an unknown one."""
    png = await lanes.status(calibration.front_png, ctx, calibration_id, x, y)
    return Response(png, media_type="image/png")


@router.delete(
    "/calibrations/{calibration_id}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "deleted: its request, result and front"},
        404: {"description": "no such calibration: never, or deleted already (a repeated DELETE)"},
        409: {"description": "its job is queued or running: cancel it first; nothing was deleted"},
    },
)
def delete_calibration(calibration_id: str, ctx: ContextDep) -> Response:
    """Delete a calibration's records (admin). Its probes, its recommended variant and its job's record
    stay: others may share the first two, and the job history keeps the third. A second DELETE is a 404."""
    delete_calibration_records(ctx, calibration_id)
    return Response(status_code=204)
