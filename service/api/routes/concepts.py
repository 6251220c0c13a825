"""Concept datasets: JSON records or a multipart JSONL upload."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api_schemas import Concept, ConceptCreate, ConceptSubmission
from service import registry
from service.api.deps import ContextDep, LanesDep
from service.api.routes.jobs import job_view
from service.errors import InvalidInput, ProblemError

router = APIRouter(tags=["concepts"])

_MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["name", "models", "dataset"],
    "properties": {
        "name": {"type": "string"},
        "models": {"type": "string", "description": "model IDs, repeated or comma-separated"},
        "role": {"type": "string", "enum": ["target", "reference"]},
        "description": {"type": "string"},
        "callback_url": {"type": "string", "description": "POSTed each collection job when it ends"},
        "dataset": {"type": "string", "format": "binary", "description": "JSONL, one record per line"},
    },
}
_OPENAPI_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ConceptCreate"}},
            "multipart/form-data": {"schema": _MULTIPART_SCHEMA},
        },
    }
}


class UnsupportedMediaType(ProblemError):
    status, title, slug = 415, "Unsupported media type", "unsupported-media-type"


class MalformedBody(ProblemError):
    status, title, slug = 400, "Malformed body", "malformed-body"


@router.post("/concepts", response_model=ConceptSubmission, status_code=202, openapi_extra=_OPENAPI_BODY)
async def create_concept(request: Request, ctx: ContextDep) -> dict[str, Any]:
    """Store a concept's records and start collecting its statistics on each listed model."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        fields = await _multipart_fields(request)
    elif content_type.startswith("application/json"):
        try:
            fields = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MalformedBody(f"the request body is not valid JSON: {exc}") from None
    else:
        raise UnsupportedMediaType("send application/json or multipart/form-data with a JSONL 'dataset' part")
    body = _validate(fields)
    concept, jobs = await run_in_threadpool(
        registry.submit_concept,
        ctx,
        name=body.name,
        role=body.role,
        description=body.description,
        raw_records=body.records,
        models=body.models,
        callback_url=body.callback_url,
    )
    return {"concept": concept, "jobs": [job_view(j) for j in jobs]}


def _validate(fields: Any) -> ConceptCreate:
    try:
        return ConceptCreate.model_validate(fields)
    except ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
        raise InvalidInput(detail, errors=errors) from None


async def _multipart_fields(request: Request) -> dict[str, Any]:
    form = await request.form(max_files=1, max_fields=64)
    try:
        upload = form.get("dataset")
        if not isinstance(upload, UploadFile):
            raise InvalidInput("multipart upload needs a file part named 'dataset' (JSONL)")
        records = _parse_jsonl(await upload.read())
        models = [m.strip() for value in form.getlist("models") for m in str(value).split(",") if m.strip()]
        fields: dict[str, Any] = {"name": form.get("name"), "models": models, "records": records}
        for optional in ("role", "description", "callback_url"):
            if form.get(optional) is not None:
                fields[optional] = form.get(optional)
        return fields
    finally:
        await form.close()


def _parse_jsonl(data: bytes) -> list[Any]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedBody("the dataset is not UTF-8 text") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise MalformedBody(f"dataset line {number} is not valid JSON: {exc.msg}") from None
    return records


@router.get("/concepts", response_model=list[Concept])
async def list_concepts(ctx: ContextDep, lanes: LanesDep) -> list[dict[str, Any]]:
    """Every concept with its per-model collection status."""
    return await lanes.status(lambda: [registry.concept_view(ctx, c) for c in registry.list_concepts(ctx, recent=True)])


@router.get("/concepts/{name}", response_model=Concept)
async def get_concept(name: str, ctx: ContextDep, lanes: LanesDep) -> dict[str, Any]:
    """One concept."""
    return await lanes.status(lambda: registry.concept_view(ctx, registry.get_concept(ctx, name, recent=True)))


@router.delete("/concepts/{name}", status_code=204, response_class=Response)
def delete_concept(name: str, ctx: ContextDep) -> Response:
    """Delete a concept (cached statistics and built variants stay)."""
    registry.delete_concept(ctx, name)
    return Response(status_code=204)
