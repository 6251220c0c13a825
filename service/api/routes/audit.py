"""The audit log: who changed what, when, and with what answer (admin keys only: :func:`service.api.auth.required_scope`)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from api_schemas.audit import AuditEntry
from service.api.audit import AuditFilter, audit_keys, read_entry
from service.api.deps import ContextDep, LanesDep
from service.api.pagination import PAGED_HEADERS, Page, PageDep, SortKey
from service.api.routes.jobs import IsoTime
from service.context import Context

router = APIRouter(tags=["operations"])


@router.get("/audit", response_model=list[AuditEntry], responses=PAGED_HEADERS)
async def list_audit(
    ctx: ContextDep,
    lanes: LanesDep,
    page: PageDep,
    key: Annotated[str | None, Query(max_length=64, description="only this key's fingerprint (key-…, or anonymous)")] = None,
    method: Annotated[Literal["POST", "PUT", "PATCH", "DELETE"] | None, Query(description="only this method")] = None,
    path_prefix: Annotated[str | None, Query(max_length=1024, description="only paths starting with this")] = None,
    status: Annotated[int | None, Query(ge=100, le=599, description="only this status code")] = None,
    since: Annotated[IsoTime | None, Query(description="only requests at or after this time (UTC if no zone)")] = None,
    until: Annotated[IsoTime | None, Query(description="only requests before this time")] = None,
) -> list[AuditEntry]:
    """Every state-changing request (POST, PUT, PATCH, DELETE) and its answer, oldest first: one page
    (``limit``, ``cursor``). A bounded time range (``since`` and ``until``) reads only its days."""
    wanted = AuditFilter(key, method, path_prefix, status, since, until)
    return page.answer(*await lanes.status(_audit_page, ctx, page, wanted))


def _audit_page(ctx: Context, page: Page, wanted: AuditFilter) -> tuple[list[AuditEntry], SortKey | None]:
    def view(sort_key: SortKey) -> AuditEntry | None:
        entry = read_entry(ctx.storage, sort_key[0])
        return entry if entry is not None and wanted.matches(entry) else None

    return page.select(((k,) for k in audit_keys(ctx.storage, wanted.since, wanted.until)), view)
