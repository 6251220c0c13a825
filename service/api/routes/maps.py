"""Memory-trace maps of a model: ρ by block and module type, as JSON or as a PNG heatmap."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response

from service.api.deps import ContextDep
from service.context import Context
from service.maps import build, render

router = APIRouter(tags=["models"])
ConceptsQuery = Annotated[list[str], Query(description="concept names, repeated or comma-separated")]
ReferenceQuery = Annotated[list[str] | None, Query(description="default: every concept ready on the model")]
RcondQuery = Annotated[float | None, Query(gt=0.0, lt=1.0, description="pseudo-inverse cut (default D·eps32)")]
PixelsQuery = Annotated[int | None, Query(ge=200, le=4000)]
MeasureQuery = Annotated[
    Literal["data", "weight"],
    Query(description="data: ‖W⁺X‖F / ‖WX‖F over the universe's inputs (0 to 1); weight: the paper's ‖W⁺‖F / ‖W‖F"),
]


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _map(
    ctx: Context, model_id: str, concepts: list[str], reference: list[str] | None, rcond: float | None, measure: str
) -> Any:
    return build.engram_map(ctx, model_id, _split(concepts) or [], _split(reference), rcond, measure)


_PNG: dict[int | str, dict[str, Any]] = {200: {"content": {"image/png": {}}}}


@router.get("/models/{model_id:path}/engram-map.png", response_class=Response, responses=_PNG)
def engram_map_png(
    model_id: str,
    ctx: ContextDep,
    concepts: ConceptsQuery,
    reference: ReferenceQuery = None,
    rcond: RcondQuery = None,
    width: PixelsQuery = None,
    height: PixelsQuery = None,
    measure: MeasureQuery = "data",
) -> Response:
    """The paper's Fig. 4 for these concepts: one heatmap per concept (blocks × module types, and the
    layers outside the blocks), every panel on one colour scale."""
    data = _map(ctx, model_id, concepts, reference, rcond, measure)
    default_width, default_height = render.default_size(data)
    png = render.render_png(data, width or default_width, height or default_height)
    return Response(png, media_type="image/png")


@router.get("/models/{model_id:path}/engram-map")
def engram_map_json(
    model_id: str,
    ctx: ContextDep,
    concepts: ConceptsQuery,
    reference: ReferenceQuery = None,
    rcond: RcondQuery = None,
    measure: MeasureQuery = "data",
) -> dict[str, Any]:
    """Where each concept's engram lives, by block and module type: ``‖W_l⁺X‖_F / ‖W_l X‖_F`` over the
    universe's inputs (``measure=data``), or ``‖W_l⁺‖_F / ‖W_l‖_F`` (``measure=weight``)."""
    return _map(ctx, model_id, concepts, reference, rcond, measure)
