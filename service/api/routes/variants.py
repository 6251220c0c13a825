"""Variants and their files (with HTTP Range)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse

from api_schemas import Variant
from service import registry
from service.api.deps import ContextDep, LanesDep
from service.errors import NotFound, ProblemError

router = APIRouter(tags=["variants"])
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RangeNotSatisfiable(ProblemError):
    status, title, slug = 416, "Range not satisfiable", "range-not-satisfiable"


@router.get("/variants", response_model=list[Variant])
async def list_variants(ctx: ContextDep, lanes: LanesDep, model_id: str | None = None) -> list[dict[str, Any]]:
    """Every variant, or only those of ``?model_id=``."""
    return await lanes.status(registry.list_variants, ctx, model_id)


@router.get("/variants/{variant_id}", response_model=Variant)
async def get_variant(variant_id: str, ctx: ContextDep, lanes: LanesDep) -> dict[str, Any]:
    """A variant: its terms, options, status and files."""
    return await lanes.status(registry.variant_view, ctx, variant_id)


@router.get("/variants/{variant_id}/files/{path:path}", response_class=Response)
def download_file(variant_id: str, path: str, request: Request, ctx: ContextDep) -> Response:
    """The bytes of one file of a ready variant; ``Range: bytes=a-b`` gives a 206.

    With ``ENGRAM_PRESIGN_DOWNLOADS`` on a backend that can presign (S3), the answer is a 307 to a
    short-lived presigned URL instead: the bytes then flow from S3 to the client, not through the API.
    """
    manifest = registry.variant_manifest(ctx, variant_id)
    if manifest is None:
        raise NotFound(f"variant {variant_id} has no files (unknown or not ready)")
    entry = next((f for f in manifest["files"] if f["path"] == path), None)
    if entry is None:  # only listed paths: '..' or absolute paths can never match
        raise NotFound(f"variant {variant_id} has no file {path!r}")
    key, size = f"variants/{variant_id}/files/{path}", int(entry["size"])
    presign = getattr(ctx.storage, "presigned_url", None)
    if ctx.settings.presign_downloads and presign is not None:
        # 307 keeps the method and lets the client resend its Range header to S3, which honours it.
        return RedirectResponse(presign(key, ctx.settings.presign_expiry_s), status_code=307)
    headers = {"Accept-Ranges": "bytes", "ETag": f'"{entry["sha256"]}"'}
    start, end, status = 0, size - 1, 200
    header = request.headers.get("range")
    if header:
        start, end = _parse_range(header, size)
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    headers["Content-Length"] = str(max(0, end - start + 1))
    body = ctx.storage.iter_range(key, start, end) if size else iter([b""])
    return StreamingResponse(body, status_code=status, headers=headers, media_type="application/octet-stream")


def _parse_range(header: str, size: int) -> tuple[int, int]:
    match = _RANGE.match(header.strip())
    if match is None or match.group(0) == "bytes=-":
        raise RangeNotSatisfiable(f"unsupported Range {header!r}; use one 'bytes=start-end' range")
    first, last = match.groups()
    if first == "":  # suffix range: the last N bytes
        start, end = max(0, size - int(last)), size - 1
    else:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        raise RangeNotSatisfiable(f"Range {header!r} is outside the file's {size} bytes")
    return start, end
