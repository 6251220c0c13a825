"""Variants and their files (with HTTP Range)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse

from api_schemas import Variant
from api_schemas.variants import ReceiptKey, VariantReceipt
from service.api.auth import request_principal
from service.api.deps import ContextDep, LanesDep
from service.api.metadata_query import MetadataDep
from service.api.pagination import PAGED_HEADERS, Page, PageDep, SortKey
from service.context import Context
from service.errors import NotFound, ProblemError
from service.storage.base import Presigning
from service.storage.keys import variant_file_key
from service.variants import deletion, receipt, retention
from service.variants import service as variants
from service.variants.model_card import model_card
from service.variants.provenance import VariantFilter

router = APIRouter(tags=["variants"])
_RANGE_SPEC = re.compile(r"(\d*)-(\d*)")  # int-range "a-" / "a-b" or suffix-range "-n" (RFC 9110 §14.1.1)


class RangeNotSatisfiable(ProblemError):
    """416 with ``Content-Range: bytes */size``, so the client learns the file's length."""

    status, title, slug = 416, "Range not satisfiable", "range-not-satisfiable"

    def __init__(self, size: int) -> None:
        super().__init__(f"the requested range starts beyond the end of the file ({size} bytes)")
        self.headers = {"Content-Range": f"bytes */{size}", "Accept-Ranges": "bytes"}


@router.get("/variants", response_model=list[Variant], responses=PAGED_HEADERS)
async def list_variants(
    ctx: ContextDep,
    lanes: LanesDep,
    page: PageDep,
    meta: MetadataDep,
    model_id: str | None = None,
    concept: Annotated[str | None, Query(description="a concept among the variant's terms")] = None,
) -> list[Variant]:
    """Variants by ID, narrowed by ``model_id``, ``concept``, ``label=key:value``, ``created_by`` and
    creation time (``created_after`` inclusive, ``created_before`` exclusive): one page (``limit``, ``cursor``)."""
    narrowed = VariantFilter(concept, meta)
    return page.answer(*await lanes.status(variants_page, ctx, page, model_id, narrowed))


def variants_page(
    ctx: Context, page: Page, model_id: str | None, narrowed: VariantFilter | None = None
) -> tuple[list[Variant], SortKey | None]:
    """Only the page's variants (and one more, and those the filter leaves out) are read."""
    ids = variants.variant_ids(ctx, model_id)
    return page.select(((i,) for i in ids), lambda key: variants.variant_of(ctx, key[0], model_id, narrowed))


@router.get("/variants/{variant_id}", response_model=Variant)
async def get_variant(variant_id: str, ctx: ContextDep, lanes: LanesDep) -> Variant:
    """A variant: its terms, options, status and files."""
    return await lanes.status(variants.variant_view, ctx, variant_id)


_DELETE_ANSWERS: dict[int | str, dict[str, Any]] = {
    204: {"description": "deleted: its files, manifest, plan, request, provenance and evaluations"},
    403: {"description": "a write key that did not create the variant"},
    404: {"description": "no such variant: never made, or deleted already (a repeated DELETE)"},
    409: {"description": "an unfinished job builds or reads it (named); nothing was deleted"},
}


@router.delete("/variants/{variant_id}", status_code=204, response_class=Response, responses=_DELETE_ANSWERS)
def delete_variant(variant_id: str, request: Request, ctx: ContextDep) -> Response:
    """Delete a variant and every stored object it owns (admin, or the key that created it); its
    universe and other variants stay. A second DELETE is a 404."""
    principal = request_principal(request)
    deletion.delete_variant(ctx, variant_id, deletion.Deleter(principal.key_id, principal.scope == "admin"))
    return Response(status_code=204)


_RECEIPT_ANSWERS: dict[int | str, dict[str, Any]] = {
    409: {"description": "the variant is not ready (building or failed): only a ready variant has files to vouch for"},
    503: {"description": "ENGRAM_RECEIPT_SIGNING_KEY is set but is not an unencrypted Ed25519 PEM private key"},
}


@router.get("/variants/{variant_id}/receipt", response_model=VariantReceipt, responses=_RECEIPT_ANSWERS)
async def get_receipt(variant_id: str, ctx: ContextDep, lanes: LanesDep) -> VariantReceipt:
    """The variant's receipt: its request, concepts' data and statistics, universe, base model, files
    and evaluations in one record, Ed25519-signed when the operator set ENGRAM_RECEIPT_SIGNING_KEY
    (check a downloaded folder with ``engram verify``)."""
    return await lanes.status(receipt.variant_receipt, ctx, variant_id)


@router.get(
    "/variants/{variant_id}/model-card",
    response_class=Response,
    responses={
        200: {"description": "the card", "content": {"text/markdown": {"schema": {"type": "string"}}}},
        409: {"description": "the variant is not ready"},
    },
)
async def get_model_card(variant_id: str, ctx: ContextDep, lanes: LanesDep) -> Response:
    """The variant's model card (``README.md``, Hugging Face convention: front matter with
    ``base_model`` and ``tags``), made from its receipt: what was removed, how, evaluations, digest."""
    answer = await lanes.status(receipt.variant_receipt, ctx, variant_id)
    return Response(model_card(answer), media_type="text/markdown; charset=utf-8")


@router.get(
    "/receipt-key",
    response_model=ReceiptKey,
    responses={404: {"description": "receipts are unsigned: the service has no ENGRAM_RECEIPT_SIGNING_KEY"}},
)
def get_receipt_key(ctx: ContextDep) -> ReceiptKey:
    """The Ed25519 public key variant receipts are signed with (404 when receipts are unsigned)."""
    return receipt.receipt_key(ctx)


@router.get("/variants/{variant_id}/files/{path:path}", response_class=Response)
def download_file(variant_id: str, path: str, request: Request, ctx: ContextDep) -> Response:
    """The bytes of one file of a ready variant; ``Range: bytes=a-b`` (or ``a-``, ``-n``) gives a 206.

    A range starting beyond the file is a 416 with ``Content-Range: bytes */size``; several ranges,
    another unit or a header that is not a range are ignored (200, the whole file), as RFC 9110
    allows. With ``ENGRAM_PRESIGN_DOWNLOADS`` on a backend that can presign (S3), the answer is a 307
    to a short-lived presigned URL instead: the bytes then flow from S3 to the client, not through the API.
    """
    return _file_response(ctx, variant_id, path, request.headers.get("range"), with_body=True)


@router.head("/variants/{variant_id}/files/{path:path}", response_class=Response)
def head_file(variant_id: str, path: str, request: Request, ctx: ContextDep) -> Response:
    """The headers a GET of the same file and ``Range`` answers with (length, ETag, range), no body."""
    return _file_response(ctx, variant_id, path, request.headers.get("range"), with_body=False)


def _file_response(ctx: Context, variant_id: str, path: str, range_header: str | None, *, with_body: bool) -> Response:
    # The request first (cached a second at most): a variant deleted by another process is a 404 here.
    found = variants.find_variant_request(ctx, variant_id, recent=True) is not None
    manifest = variants.variant_manifest(ctx, variant_id) if found else None
    if manifest is None:
        raise NotFound(f"variant {variant_id} has no files (unknown or not ready)")
    entry = manifest.file(path)
    if entry is None:  # only listed paths: '..' or absolute paths can never match
        raise NotFound(f"variant {variant_id} has no file {path!r}")
    key, size = variant_file_key(variant_id, path), entry.size
    if with_body:
        retention.note_download(ctx, variant_id)  # least recently downloaded goes first (when a bound is set)
    storage = ctx.storage
    if with_body and ctx.settings.presign_downloads and isinstance(storage, Presigning):
        # 307 keeps the method and lets the client resend its Range header to S3, which honours it.
        # (Not for HEAD: a presigned GET URL is signed for GET only; the headers are known here.)
        return RedirectResponse(storage.presigned_url(key, ctx.settings.presign_expiry_s), status_code=307)
    headers = {"Accept-Ranges": "bytes", "ETag": f'"{entry.sha256}"'}
    start, end, status = 0, size - 1, 200
    selected = _parse_range(range_header, size) if range_header else None
    if selected is not None:
        (start, end), status = selected, 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    headers["Content-Length"] = str(max(0, end - start + 1))
    if not with_body:
        return Response(status_code=status, headers=headers, media_type="application/octet-stream")
    body = ctx.storage.iter_range(key, start, end) if size else iter([b""])
    return StreamingResponse(body, status_code=status, headers=headers, media_type="application/octet-stream")


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The byte range ``[start, end]`` a ``Range`` header selects in a file of ``size`` bytes.

    Returns ``None`` where the header is to be ignored (RFC 9110 §14.2): another unit than
    ``bytes``, not a range, ``last < first``, or several ranges (no multipart/byteranges here).
    Positions are compared as digit strings and clamped to the file, so a number of any length is
    never converted whole.

    Raises:
        RangeNotSatisfiable: the range starts at or beyond the end of the file (or asks for the
            last 0 bytes).
    """
    unit, equals, ranges = header.partition("=")
    if not equals or unit.strip().lower() != "bytes":
        return None
    specs = [spec.strip() for spec in ranges.split(",") if spec.strip()]  # a #list may have empty elements
    match = _RANGE_SPEC.fullmatch(specs[0]) if len(specs) == 1 else None
    if match is None:
        return None
    first, last = match.groups()
    if first == last == "":
        return None
    if first == "":  # suffix range: the last N bytes
        count = _clamped(last, size)
        if count == 0:
            raise RangeNotSatisfiable(size)
        return size - count, size - 1
    if last and _digits_key(last) < _digits_key(first):
        return None
    start = _clamped(first, size)
    if start >= size:
        raise RangeNotSatisfiable(size)
    return start, min(_clamped(last, size), size - 1) if last else size - 1


def _digits_key(digits: str) -> tuple[int, str]:
    """Orders digit strings by value without converting them."""
    significant = digits.lstrip("0") or "0"
    return len(significant), significant


def _clamped(digits: str, limit: int) -> int:
    """``min(int(digits), limit)``, for digit strings of any length (leading zeros included)."""
    length, significant = _digits_key(digits)
    return limit if (length, significant) > _digits_key(str(limit)) else min(int(significant), limit)
