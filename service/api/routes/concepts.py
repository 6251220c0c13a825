"""Concept datasets: JSON records, a multipart JSONL upload, or a dataset reference the worker fetches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import Field, ValidationError
from starlette.concurrency import run_in_threadpool

from api_schemas import Concept, ConceptCreate, ConceptSubmission
from service.api import concept_deletion
from service.api.auth import request_principal
from service.api.deps import ContextDep, LanesDep
from service.api.metadata_query import MetadataDep
from service.api.pagination import PAGED_HEADERS, PageDep, SortKey
from service.api.request_errors import invalid_input
from service.api.routes.jobs import job_view
from service.api.uploads import read_upload
from service.concepts import service as concepts
from service.concepts.sampled import submitted_samples
from service.datasets.refs import submitted_reference
from service.datasets.spool import SpooledDataset, spool_records
from service.errors import InvalidInput, MalformedBody, ProblemError
from service.storage.base import scratch_dir
from service.storage.keys import concept_key
from service.storage.stored_json import skip_unreadable

router = APIRouter(tags=["concepts"])
_MAX_INT_DIGITS = 4300  # sys.get_int_max_str_digits() by default: json.loads refuses longer integers

_MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["name", "models", "dataset"],
    "properties": {
        "name": {"type": "string"},
        "models": {"type": "string", "description": "model IDs, repeated or comma-separated"},
        "role": {"type": "string", "enum": ["target", "reference"]},
        "description": {"type": "string"},
        "callback_url": {"type": "string", "description": "POSTed each collection job when it ends"},
        "modules": {"type": "string", "description": "module-name suffixes to collect, repeated or comma-separated"},
        "template": {"type": "string", "enum": ["chat"], "description": "prompt/completion records as one-turn chats"},
        "labels": {"type": "string", "description": 'a JSON object of key/value strings, e.g. {"ticket": "T-42"}'},
        "reason": {"type": "string", "description": "why the concept is made (a deletion request, a ticket)"},
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


class _UploadFields(ConceptCreate):
    """A multipart upload's form fields: the records come in the streamed ``dataset`` part."""

    records: list[dict[str, Any]] = Field(default_factory=list)


@router.post("/concepts", response_model=ConceptSubmission, status_code=202, openapi_extra=_OPENAPI_BODY)
async def create_concept(request: Request, ctx: ContextDep) -> ConceptSubmission:
    """Store a concept's records and start collecting its statistics on each listed model.

    A role left out keeps an existing concept's role (a new concept is a ``target``); another role
    than the stored one is a 409, like other records. With a ``dataset`` reference instead of
    records, nothing is fetched here: the concept waits for its collection jobs to resolve it
    (``dataset.status`` pending, then resolved or failed). Posting the same reference again starts
    nothing new while what it names is unchanged (size and mtime, ETag or version, hub commit);
    once it changed, the concept is posted anew over the new content.
    """
    content_type = request.headers.get("content-type", "")
    _check_identity_coding(request.headers.get("content-encoding", "identity"))
    settings = ctx.settings
    dataset: SpooledDataset | None
    with scratch_dir("upload") as tmp:
        if content_type.startswith("multipart/form-data"):
            upload = await read_upload(
                request,
                Path(tmp),
                max_records=settings.max_records,
                max_bytes=settings.max_upload_bytes,
                max_record_bytes=settings.max_record_bytes,
                max_image_pixels=settings.max_image_pixels,
            )
            body: ConceptCreate = _validate(_UploadFields, _form_fields(upload.fields))
            dataset = upload.dataset
        elif content_type.startswith("application/json"):
            raw = await request.body()
            body, dataset = await run_in_threadpool(
                _json_concept, raw, Path(tmp), settings.max_records, settings.max_record_bytes, settings.max_image_pixels
            )
        else:
            raise UnsupportedMediaType("send application/json or multipart/form-data with a JSONL 'dataset' part")
        # A reference is only checked (scheme, shape, roots, row range) and fingerprinted (a stat, a
        # HEAD or the hub's commit: what content it names now, never its bytes); the job fetches it.
        samples = await run_in_threadpool(submitted_samples, ctx, body.models, body.samples)
        reference = None
        if body.dataset is not None:
            reference = await run_in_threadpool(submitted_reference, body.dataset.model_dump(), settings)
        concept, jobs = await run_in_threadpool(
            concepts.submit_concept,
            ctx,
            name=body.name,
            role=body.role if "role" in body.model_fields_set else None,
            description=body.description,
            dataset=dataset,
            models=body.models,
            callback_url=body.callback_url,
            modules=body.modules,
            reference=reference,
            template=body.template if "template" in body.model_fields_set else concepts.KEEP,
            samples=samples,
            meta=body,
        )
    return ConceptSubmission(concept=concept, jobs=[job_view(j) for j in jobs])


def _check_identity_coding(coding: str) -> None:
    """Refuse a compressed request body (``Content-Encoding``; RFC 9110 says 415): the server does
    not inflate bodies, and reading the compressed bytes as JSON would answer "not UTF-8". A
    compressed dataset goes as a gzip-compressed multipart ``dataset`` part, which is read."""
    if coding.strip().lower() not in {"", "identity"}:
        raise UnsupportedMediaType(
            f"Content-Encoding {coding!r} is not read: send the body uncompressed, or the records as a "
            "gzip-compressed JSONL file in a multipart 'dataset' part"
        )


def _json_concept(
    raw: bytes, directory: Path, max_records: int, max_record_bytes: int, max_image_pixels: int
) -> tuple[ConceptCreate, SpooledDataset | None]:
    """A JSON body decoded, validated and its records spooled (in a worker thread: bodies run to
    ``ENGRAM_MAX_JSON_BYTES``)."""
    try:
        fields = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MalformedBody(f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # Python reads no integer of over 4,300 digits (CVE-2020-10735)
        raise MalformedBody(
            f"the request body holds a number of over {_MAX_INT_DIGITS} digits; no field takes one"
        ) from None
    except RecursionError:
        raise MalformedBody("the request body is nested too deeply") from None
    body = _validate(ConceptCreate, fields)
    if body.records is None:  # a dataset reference
        return body, None
    return body, spool_records(body.records, directory / "dataset.jsonl", max_records, max_record_bytes, max_image_pixels)


def _form_fields(form: dict[str, list[str]]) -> dict[str, Any]:
    _require_models(form)
    models = [m.strip() for value in form.get("models", []) for m in value.split(",") if m.strip()]
    fields: dict[str, Any] = {"name": form["name"][-1] if "name" in form else None, "models": models}
    for optional in ("role", "description", "callback_url", "template", "reason"):
        if optional in form:
            fields[optional] = form[optional][-1]
    if "labels" in form:
        fields["labels"] = _form_labels(form["labels"][-1])
    if "modules" in form:
        fields["modules"] = [m.strip() for value in form["modules"] for m in value.split(",") if m.strip()]
    return fields


def _form_labels(text: str) -> Any:
    """The ``labels`` form field: a JSON object (its keys and values are checked as in a JSON body)."""
    try:
        return json.loads(text)
    except ValueError:
        detail = 'the multipart field labels is not JSON: send a JSON object, e.g. -F \'labels={"ticket": "T-42"}\''
        raise InvalidInput(detail, errors=[{"loc": ["labels"], "msg": detail, "type": "json_invalid"}]) from None


def _require_models(form: dict[str, list[str]]) -> None:
    """A missing ``models`` field is refused with how to send it (pydantic's words name a list length)."""
    if any(m.strip() for value in form.get("models", []) for m in value.split(",")):
        return
    detail = (
        "the multipart form has no 'models' field (or an empty one): name the model(s) to collect on with "
        "-F models=<model id> (repeat it, or separate IDs with commas)"
    )
    raise InvalidInput(detail, errors=[{"loc": ["models"], "msg": detail, "type": "missing"}])


def _validate(schema: type[ConceptCreate], fields: Any) -> ConceptCreate:
    try:
        return schema.model_validate(fields)
    except ValidationError as exc:  # the same answers as every other route's body (closest field names)
        raise invalid_input(exc.errors(), schema) from None
    except RecursionError:  # a JSON body nested just short of json's limit, then deeper for pydantic
        raise MalformedBody("the request body is nested too deeply") from None


@router.get("/concepts", response_model=list[Concept], responses=PAGED_HEADERS)
async def list_concepts(ctx: ContextDep, lanes: LanesDep, page: PageDep, meta: MetadataDep) -> list[Concept]:
    """Concepts by name, with their per-model collection status, narrowed by ``label=key:value``,
    ``created_by`` and creation time (``created_after`` inclusive, ``created_before`` exclusive): one
    page (``limit``, ``cursor``)."""

    def view(key: SortKey) -> Concept | None:
        concept = concepts.find_concept(ctx, key[0], recent=True)  # None: deleted since it was listed
        shown = None if concept is None else concepts.concept_view(ctx, concept)
        return shown if shown is not None and meta.admits(shown) else None

    def readable_view(key: SortKey) -> Concept | None:  # one unreadable concept is left out, logged by name
        return skip_unreadable(concept_key(key[0]), lambda: view(key))

    keys = await lanes.status(lambda: [(name,) for name in concepts.concept_names(ctx)])
    return page.answer(*await lanes.status(page.select, keys, readable_view))


@router.get("/concepts/{name}", response_model=Concept)
async def get_concept(name: str, ctx: ContextDep, lanes: LanesDep) -> Concept:
    """One concept."""
    return await lanes.status(lambda: concepts.concept_view(ctx, concepts.get_concept(ctx, name, recent=True)))


_DELETE_ANSWERS: dict[int | str, dict[str, Any]] = {
    204: {"description": "deleted: its record, its statistics and its dataset (those no other concept names)"},
    403: {"description": "a write key that did not create the concept"},
    404: {"description": "no such concept: never posted, or deleted already (a repeated DELETE)"},
    409: {"description": "a job or a stored variant still needs it: `dependents` names each, by kind; nothing was deleted"},
}


@router.delete("/concepts/{name}", status_code=204, response_class=Response, responses=_DELETE_ANSWERS)
def delete_concept(name: str, request: Request, ctx: ContextDep) -> Response:
    """Delete a concept and every stored object it owns (admin, or the key that created it): its
    record, its statistics and its dataset, unless another concept names the same ones. Refused (409,
    naming them) while a job collects it or reads it, and while a stored variant's universe includes
    it. A second DELETE is a 404."""
    concept_deletion.delete_concept(ctx, name, request_principal(request))
    return Response(status_code=204)


_STATISTICS_ANSWERS: dict[int | str, dict[str, Any]] = {
    **_DELETE_ANSWERS,
    204: {"description": "deleted: its statistics (on model_id, or every model) and its collections there"},
    404: {"description": "no such concept, or it has no collection on model_id"},
}


@router.delete("/concepts/{name}/statistics", status_code=204, response_class=Response, responses=_STATISTICS_ANSWERS)
def delete_statistics(name: str, request: Request, ctx: ContextDep, model_id: str | None = None) -> Response:
    """Delete a concept's statistics (the per-layer covariances: what it weighs) on ``model_id``, or
    on every model, and its collections there; the concept and its dataset stay (posting it again
    with those models collects them anew). The same rules as deleting the concept."""
    concept_deletion.delete_statistics(ctx, name, request_principal(request), model_id)
    return Response(status_code=204)
