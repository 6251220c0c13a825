"""Jobs: what every route that takes time answers (``GET /jobs/{job_id}``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from api_schemas.common import Problem


class JobProgress(BaseModel):
    done: int = 0
    total: int = 0
    unit: str = "items"


class Job(BaseModel):
    job_id: str
    kind: Literal["collect", "variant", "universe", "evaluate", "generate", "calibrate", "map", "register"]
    model_id: str | None = Field(default=None, description="the model a collection, build, map or registration is for")
    concept: str | None = Field(default=None, description="the concept a collection is for")
    variant_id: str | None = Field(default=None, description="the variant built, evaluated or generated from")
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    progress: JobProgress
    error: Problem | None = None
    result: dict[str, Any] | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
