"""The audit log: one entry per state-changing request (``GET /audit``)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

AUDIT_FORMAT_VERSION: Literal[1] = 1


class AuditEntry(BaseModel):
    """Who asked what, when, and what the service answered. Never a key, a header, a query value or a
    body: only the method, the route, the path's own parameters, the names of the query parameters,
    the IDs the answer named and its status."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = AUDIT_FORMAT_VERSION
    at: datetime = Field(description="when the request arrived (UTC)")
    request_id: str = Field(description="the request's X-Request-ID (as answered), to find its log lines")
    key: str | None = Field(
        description="the API key's fingerprint (key- and 12 hex digits of its SHA-256); 'anonymous' when auth is "
        "off; null when no valid key was presented (a 401) or the request was refused before auth (a 413)"
    )
    scope: str | None = Field(default=None, description="the key's scope")
    method: str
    route: str | None = Field(description="the route template matched (null: no route matched)")
    path: str = Field(description="the path requested, without its query string")
    path_params: dict[str, str] = Field(default_factory=dict, description="the route's path parameters")
    query: list[str] = Field(default_factory=list, description="the names of the query parameters sent (not their values)")
    resources: dict[str, str] = Field(
        default_factory=dict, description="the resource IDs the answer named (job_id, variant_id …, Location)"
    )
    status: int = Field(description="the status code answered (500 for a request that crashed)")
    problem: str | None = Field(default=None, description="the problem's title, for an error")
    duration_ms: float
