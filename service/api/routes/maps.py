"""Memory-trace maps of a model: ρ by block and module type, as JSON or as a PNG heatmap."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from service import engram_maps
from service.api.deps import ContextDep
from service.registry import Context

router = APIRouter(tags=["models"])
ConceptsQuery = Annotated[list[str], Query(description="concept names, repeated or comma-separated")]
ReferenceQuery = Annotated[list[str] | None, Query(description="default: every concept ready on the model")]
RcondQuery = Annotated[float | None, Query(gt=0.0, lt=1.0, description="pseudo-inverse cut (default D·eps32)")]
PixelsQuery = Annotated[int | None, Query(ge=200, le=4000)]


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _map(ctx: Context, model_id: str, concepts: list[str], reference: list[str] | None, rcond: float | None) -> Any:
    return engram_maps.engram_map(ctx, model_id, _split(concepts) or [], _split(reference), rcond)


_PNG = {200: {"content": {"image/png": {}}}}


@router.get("/models/{model_id:path}/engram-map.png", response_class=Response, responses=_PNG)
def engram_map_png(
    model_id: str,
    ctx: ContextDep,
    concepts: ConceptsQuery,
    reference: ReferenceQuery = None,
    rcond: RcondQuery = None,
    width: PixelsQuery = None,
    height: PixelsQuery = None,
) -> Response:
    """The paper's Fig. 4 for these concepts: one heatmap of ρ_l per concept (blocks × module types)."""
    data = _map(ctx, model_id, concepts, reference, rcond)
    default_width, default_height = engram_maps.default_size(data)
    png = engram_maps.render_png(data, width or default_width, height or default_height)
    return Response(png, media_type="image/png")


@router.get("/models/{model_id:path}/engram-map")
def engram_map_json(
    model_id: str, ctx: ContextDep, concepts: ConceptsQuery, reference: ReferenceQuery = None, rcond: RcondQuery = None
) -> dict[str, Any]:
    """``ρ_l = ‖W_l⁺‖_F / ‖W_l‖_F`` of each concept's engram, by block and module type."""
    return _map(ctx, model_id, concepts, reference, rcond)
