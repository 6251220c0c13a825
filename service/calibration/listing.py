"""``GET /calibrations``: every calibration by ID, each as a summary (:class:`CalibrationSummary`).

A calibration is its ``calibrations/<id>/request.json`` (written when it is submitted); its status
and result are read as ``GET /calibrations/{id}`` reads them (:func:`calibration_view`), its creation
time from its job's record. A calibration whose records cannot be read is left out of the list with
a warning naming it (reading it by ID refuses it), as the variants' list does.
"""

from __future__ import annotations

from api_schemas import Calibration, CalibrationRecommendation
from api_schemas.calibration_list import CalibrationSummary, RecommendationHeadline
from service.calibration.service import calibration_view
from service.context import Context
from service.errors import NotFound
from service.models.registry import get_model
from service.storage.keys import CALIBRATIONS, calibration_request_key
from service.storage.stored_json import skip_unreadable


def calibration_ids(ctx: Context, model_id: str | None = None) -> list[str]:
    """Every calibration's ID, sorted (404 when ``model_id`` names no registered model)."""
    if model_id is not None:
        get_model(ctx, model_id)
    listed = ctx.reads.recent_listing(CALIBRATIONS)
    return sorted({k.removeprefix(CALIBRATIONS).split("/")[0] for k in listed if k.endswith("/request.json")})


def calibration_summary(ctx: Context, calibration_id: str, model_id: str | None) -> CalibrationSummary | None:
    """The calibration's summary when it exists and is ``model_id``'s (any model's: None), else None."""
    try:
        view = skip_unreadable(calibration_request_key(calibration_id), lambda: calibration_view(ctx, calibration_id))
    except NotFound:  # deleted since it was listed
        return None
    if view is None or (model_id is not None and view.model_id != model_id):
        return None
    return summarize(ctx, view)


def summarize(ctx: Context, view: Calibration) -> CalibrationSummary:
    """A calibration's list entry: its subject and status, and the headline of its result once there."""
    job = ctx.jobs.get(view.job_id) if view.job_id else None
    result = view.result
    return CalibrationSummary(
        calibration_id=view.calibration_id,
        model_id=view.model_id,
        concepts=view.concepts,
        universe_id=view.universe_id,
        status=view.status,
        job_id=view.job_id,
        created_at=job.created_at if job is not None else None,
        candidates=result.evaluations if result is not None else None,
        recommended=_headline(result.recommended) if result is not None and result.recommended is not None else None,
        note=result.note if result is not None else None,
        warnings=len(result.warnings) if result is not None else 0,
    )


def _headline(rec: CalibrationRecommendation) -> RecommendationHeadline:
    return RecommendationHeadline(
        candidate=rec.candidate,
        options=rec.options,
        forget_nll_ratio=rec.forget_nll_ratio,
        retain_nll_ratio=rec.retain_nll_ratio,
        forget_exact_match=rec.forget_exact_match,
        retain_exact_match=rec.retain_exact_match,
        variant_id=rec.variant_id,
        format=rec.format,
    )
