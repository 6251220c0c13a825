"""Model registration and listing, and the edit requests addressed to a model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from api_schemas import ComposeRequest, Model, ModelCreate, UnlearnRequest, Variant, VariantSubmission
from api_schemas.models import EditOptions
from service.api.deps import ContextDep, LanesDep
from service.api.routes.jobs import job_view
from service.context import Context
from service.models import registry
from service.variants import service as variants

router = APIRouter(tags=["models"])
EDIT_OPTIONS = tuple(EditOptions.model_fields)  # every edit option, named once in api_schemas


@router.post("/models", response_model=Model, status_code=201)
def register_model(body: ModelCreate, ctx: ContextDep, response: Response) -> dict[str, Any]:
    """Register a checkpoint (201), or return the identical registration (200)."""
    manifest, created = registry.register_model(ctx, body.model_id, body.source)
    response.status_code = 201 if created else 200
    return registry.model_view(manifest)


@router.get("/models", response_model=list[Model])
async def list_models(ctx: ContextDep, lanes: LanesDep) -> list[dict[str, Any]]:
    """Every registered model."""
    return [registry.model_view(m) for m in await lanes.status(registry.list_models, ctx)]


@router.post("/models/{model_id:path}/unlearn", response_model=VariantSubmission, status_code=202)
def unlearn(model_id: str, body: UnlearnRequest, ctx: ContextDep, response: Response) -> dict[str, Any]:
    """Remove concepts: ``W_new = W − α Σ_k f_l W_k⁺`` (202 building, 200 when it exists)."""
    terms = variants.coefficients_for_unlearn(body.concepts, body.alpha)
    return _submit(ctx, model_id, terms, body.alpha, body.model_dump(include=set(EDIT_OPTIONS)), response)


@router.post("/models/{model_id:path}/compose", response_model=VariantSubmission, status_code=202)
def compose(model_id: str, body: ComposeRequest, ctx: ContextDep, response: Response) -> dict[str, Any]:
    """Engram arithmetic: ``W_new = W + Σ_k c_k f_l W_k⁺``."""
    return _submit(ctx, model_id, body.terms, None, body.model_dump(include=set(EDIT_OPTIONS)), response)


def _submit(
    ctx: Context,
    model_id: str,
    terms: dict[str, float],
    alpha: float | None,
    options: dict[str, Any],
    response: Response,
) -> dict[str, Any]:
    variant, job = variants.submit_variant(ctx, model_id, terms, alpha, options)
    response.status_code = 200 if variant["status"] == "ready" else 202
    return {"variant": variant, "job": job_view(job) if job else None}


@router.get("/models/{model_id:path}/variants", response_model=list[Variant])
async def list_variants(model_id: str, ctx: ContextDep, lanes: LanesDep) -> list[dict[str, Any]]:
    """Every variant built from this model."""
    return await lanes.status(variants.list_variants, ctx, model_id)


@router.get("/models/{model_id:path}", response_model=Model)
async def get_model(model_id: str, ctx: ContextDep, lanes: LanesDep) -> dict[str, Any]:
    """One model and its editable layers."""
    return registry.model_view(await lanes.status(registry.get_model, ctx, model_id))
