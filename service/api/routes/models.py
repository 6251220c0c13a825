"""Model registration and listing, and the edit requests addressed to a model."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from starlette.concurrency import run_in_threadpool

from api_schemas import ComposeRequest, Job, Model, ModelCreate, UnlearnRequest, Variant, VariantSubmission
from api_schemas.models import EditOptions
from service.api.deps import ContextDep, LanesDep
from service.api.job_answers import unfinished_answer, waited
from service.api.routes.jobs import job_view
from service.context import Context
from service.models import registration, registry
from service.variants import service as variants

router = APIRouter(tags=["models"])


RegisterWaitQuery = Annotated[
    float,
    Query(
        ge=0,
        le=60,
        description=(
            "a register job inspects (and for s3:// and hf://, downloads) the checkpoint: wait up to this "
            "many seconds for it (201 with the model when it finished, else 202 with the job)"
        ),
    ),
]
DEFAULT_REGISTER_WAIT_S = 30.0  # most checkpoints register within it: 201, as when the request did it
_REGISTERING: dict[int | str, dict[str, Any]] = {
    200: {"model": Model, "description": "the identical registration exists"},
    202: {"model": Job, "description": "a job downloads the checkpoint: poll it (Location), then GET /models/{id}"},
}


@router.post("/models", response_model=Model, status_code=201, responses=_REGISTERING)
async def register_model(
    body: ModelCreate,
    ctx: ContextDep,
    lanes: LanesDep,
    response: Response,
    wait: RegisterWaitQuery = DEFAULT_REGISTER_WAIT_S,
) -> Any:
    """Register a checkpoint (201), or return the identical registration (200). A ``register`` job
    hashes and inspects it (and downloads an ``s3://`` or ``hf://`` source first): 202 with the job
    when it takes longer than ``wait``."""
    answer = await run_in_threadpool(registration.request_registration, ctx, body.model_id, body.source)
    if answer.manifest is not None:
        response.status_code = 201 if answer.created else 200
        return registry.model_view(answer.manifest)
    assert answer.job is not None  # not registered yet: a job registers it
    job = await waited(ctx, lanes, answer.job, wait)
    if job["status"] != "succeeded":
        return unfinished_answer(job, f"the registration of {body.model_id}")
    manifest = await lanes.status(registry.get_model, ctx, body.model_id)
    # 201 for the request that started the job; one that followed it answers 200, as for a registration done
    response.status_code = 201 if answer.created and job["result"].get("created", True) else 200
    return registry.model_view(manifest)


@router.get("/models", response_model=list[Model])
async def list_models(ctx: ContextDep, lanes: LanesDep) -> list[dict[str, Any]]:
    """Every registered model."""
    return [registry.model_view(m) for m in await lanes.status(registry.list_models, ctx)]


@router.post("/models/{model_id:path}/unlearn", response_model=VariantSubmission, status_code=202)
def unlearn(model_id: str, body: UnlearnRequest, ctx: ContextDep, response: Response) -> dict[str, Any]:
    """Remove concepts: ``W_new = W − α Σ_k f_l W_k⁺`` (202 building, 200 when it exists)."""
    terms = variants.coefficients_for_unlearn(body.concepts, body.alpha)
    return _submit(ctx, model_id, terms, body.alpha, body, response)


@router.post("/models/{model_id:path}/compose", response_model=VariantSubmission, status_code=202)
def compose(model_id: str, body: ComposeRequest, ctx: ContextDep, response: Response) -> dict[str, Any]:
    """Engram arithmetic: ``W_new = W + Σ_k c_k f_l W_k⁺``."""
    return _submit(ctx, model_id, body.terms, None, body, response)


def _submit(
    ctx: Context,
    model_id: str,
    terms: dict[str, float],
    alpha: float | None,
    options: EditOptions,
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
