"""Model registration and listing, and the edit requests addressed to a model."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api_schemas import ComposeRequest, EditOptions, Job, Model, ModelCreate, UnlearnRequest, Variant, VariantSubmission
from service.api.auth import request_principal
from service.api.deps import ContextDep, LanesDep
from service.api.job_answers import unfinished_answer, waited
from service.api.metadata_query import MetadataDep
from service.api.model_deletion import delete_model as delete_model_and_owned
from service.api.pagination import PAGED_HEADERS, PageDep, SortKey
from service.api.routes import variants as variant_routes
from service.context import Context
from service.models import registration, registry
from service.models.provenance import model_metadata
from service.models.record import ModelRecord
from service.variants import default_alpha
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
    answer = await run_in_threadpool(registration.request_registration, ctx, body.model_id, body.source, body)
    if isinstance(answer.outcome, ModelRecord):
        response.status_code = 201 if answer.created else 200
        return await lanes.status(model_answer, ctx, answer.outcome)
    job = await waited(ctx, lanes, answer.outcome, wait)
    if job.status != "succeeded":
        return unfinished_answer(job, f"the registration of {body.model_id}")
    manifest = await lanes.status(registry.get_model, ctx, body.model_id)
    # 201 for the request that started the job; one that followed it answers 200, as for a registration done
    response.status_code = 201 if answer.created and (job.result or {}).get("created", True) else 200
    return await lanes.status(model_answer, ctx, manifest)


def model_answer(ctx: Context, manifest: ModelRecord) -> Model:
    """The model with who registered it, when and why."""
    return registry.model_answer(manifest, model_metadata(ctx, manifest))


@router.get("/models", response_model=list[Model], responses=PAGED_HEADERS)
async def list_models(ctx: ContextDep, lanes: LanesDep, page: PageDep, meta: MetadataDep) -> list[Model]:
    """Registered models by ID, narrowed by ``label=key:value``, ``created_by`` and creation time
    (``created_after`` inclusive, ``created_before`` exclusive): one page (``limit``, ``cursor``)."""
    found = {m.model_id: m for m in await lanes.status(registry.list_models, ctx)}

    def view(key: SortKey) -> Model | None:
        shown = model_answer(ctx, found[key[0]])
        return shown if meta.admits(shown) else None

    return page.answer(*await lanes.status(page.select, [(i,) for i in sorted(found)], view))


@router.post("/models/{model_id:path}/unlearn", response_model=VariantSubmission, status_code=202)
def unlearn(model_id: str, body: UnlearnRequest, ctx: ContextDep, response: Response) -> VariantSubmission:
    """Remove concepts: ``W_new = W − α Σ_k f_l W_k⁺`` (202 building, 200 when it exists). Without
    ``alpha``: the last calibration's recommendation for these concepts, else a conservative α
    (``warnings`` says which)."""
    variants.check_options_first(ctx, model_id, body)  # a refusal of the options before any concept lookup
    resolved = default_alpha.resolve_unlearn(ctx, model_id, body)  # before the variant ID: it names the α used
    terms = variants.coefficients_for_unlearn(body.concepts, resolved.alpha)
    submission = _submit(ctx, model_id, terms, resolved.alpha, resolved.request, response)
    return submission.model_copy(update={"warnings": [*resolved.warnings, *submission.warnings]})


@router.post("/models/{model_id:path}/compose", response_model=VariantSubmission, status_code=202)
def compose(model_id: str, body: ComposeRequest, ctx: ContextDep, response: Response) -> VariantSubmission:
    """Engram arithmetic: ``W_new = W + Σ_k c_k f_l W_k⁺``."""
    return _submit(ctx, model_id, body.terms, None, body, response)


def _submit(
    ctx: Context,
    model_id: str,
    terms: dict[str, float],
    alpha: float | None,
    options: EditOptions,
    response: Response,
) -> VariantSubmission:
    submission = variants.variant_submission(ctx, model_id, terms, alpha, options)
    response.status_code = 200 if submission.variant.status == "ready" else 202
    return submission


@router.get("/models/{model_id:path}/variants", response_model=list[Variant], responses=PAGED_HEADERS)
async def list_variants(model_id: str, ctx: ContextDep, lanes: LanesDep, page: PageDep) -> list[Variant]:
    """The variants built from this model, by ID: one page (``limit``, ``cursor``)."""
    return page.answer(*await lanes.status(variant_routes.variants_page, ctx, page, model_id))


@router.get("/models/{model_id:path}", response_model=Model)
async def get_model(model_id: str, ctx: ContextDep, lanes: LanesDep) -> Model:
    """One model and its editable layers."""
    return await lanes.status(lambda: model_answer(ctx, registry.get_model(ctx, model_id)))


_DELETE_REFUSALS: dict[int | str, dict[str, Any]] = {
    204: {"description": "deleted (with ?cascade=true, its universes and calibrations too)"},
    403: {"description": "a write key that did not register the model"},
    404: {"description": "not registered: never, or deleted already (a repeated DELETE)"},
    409: {"description": "something still depends on it: `dependents` names each, by kind; nothing was deleted"},
}
CascadeQuery = Annotated[
    bool, Query(description="delete the model's universes and calibrations with it (else they are a 409)")
]


@router.delete("/models/{model_id:path}", status_code=204, response_class=Response, responses=_DELETE_REFUSALS)
def delete_model(model_id: str, request: Request, ctx: ContextDep, cascade: CascadeQuery = False) -> Response:
    """Delete a registration and every stored object it owns (admin, or the key that registered it).
    Refused (409, naming them) while a job, a variant or a concept's statistics need the model, and
    while it has universes or calibrations unless ``cascade``. A second DELETE is a 404."""
    delete_model_and_owned(ctx, model_id, request_principal(request), cascade=cascade)
    return Response(status_code=204)
