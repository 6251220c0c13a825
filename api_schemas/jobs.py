"""Jobs: what every route that takes time answers (``GET /jobs/{job_id}``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from api_schemas.common import DictReadable, Problem


class JobGroups(BaseModel):
    built: list[str] = Field(description="the universe's input groups this job built first: those of the layers it edits")
    deferred: list[str] = Field(description="the input groups left for later: built by the request that needs them")


class JobProgress(BaseModel):
    done: int = 0
    total: int = 0
    unit: str = "items"
    groups: JobGroups | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="a job that built part of its universe first: which input groups, and which it deferred",
    )


class TrackingRun(BaseModel):
    """Where a job's outcome was logged in the experiment tracker (``ENGRAM_MLFLOW_TRACKING_URI``): a
    variant's build or an evaluation, as an MLflow run. Present only when tracking is enabled."""

    tracker: Literal["mlflow"] = "mlflow"
    logged: bool = Field(description="the run was logged; false: warning says what failed (the job's own work is kept)")
    run_id: str | None = Field(default=None, description="the MLflow run")
    experiment_id: str | None = Field(default=None, description="the MLflow experiment (ENGRAM_MLFLOW_EXPERIMENT)")
    url: str | None = Field(default=None, description="the run in the MLflow UI")
    parent_run_id: str | None = Field(
        default=None, description="an evaluation: the run of its variant, which it is nested under"
    )
    warning: str | None = Field(default=None, description="logged false: what failed and what to do")


class JobResult(DictReadable):
    """A finished job's result as the model of its kind (:mod:`api_schemas.job_kinds` names them); it reads
    as the JSON object it is too (:class:`~api_schemas.common.DictReadable`). A field the service adds later
    is kept, not dropped (``extra="allow"``)."""

    model_config = ConfigDict(extra="allow")


class Job(BaseModel):
    job_id: str
    kind: Literal["collect", "variant", "universe", "evaluate", "generate", "calibrate", "map", "register"]
    model_id: str | None = Field(default=None, description="the model a collection, build, map or registration is for")
    concept: str | None = Field(default=None, description="the concept a collection is for")
    variant_id: str | None = Field(default=None, description="the variant built, evaluated or generated from")
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    progress: JobProgress
    error: Problem | None = None
    # The service answers the result as a JSON object; a client reads it as the JobResult of its kind
    # (api_schemas.job_kinds), which the document leaves out: on the wire it is the same object.
    result: dict[str, Any] | SkipJsonSchema[JobResult] | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
