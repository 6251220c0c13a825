"""Evaluation and generation on a variant: jobs, optionally awaited for a few seconds."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from api_schemas import EvaluateRequest, GenerateRequest, Job
from service import evaluation
from service.api.deps import ContextDep
from service.jobs import FINISHED, public_view
from service.registry import Context

router = APIRouter(tags=["evaluation"])
WaitQuery = Annotated[
    float, Query(ge=0, le=60, description="wait up to this many seconds: 200 with the finished job, else 202")
]


def _maybe_wait(ctx: Context, job: dict[str, Any], wait: float, response: Response) -> dict[str, Any]:
    deadline = time.monotonic() + wait
    while job["status"] not in FINISHED and time.monotonic() < deadline:
        time.sleep(0.05)
        job = ctx.jobs.get(job["job_id"]) or job
    response.status_code = 200 if job["status"] in FINISHED else 202
    return public_view(job)


@router.post("/variants/{variant_id}/evaluate", response_model=Job, status_code=202)
def evaluate(variant_id: str, body: EvaluateRequest, ctx: ContextDep, response: Response, wait: WaitQuery = 0) -> Any:
    """Answer NLL and greedy exact match per probe, for the base model and the variant.

    The job's ``result`` holds ``summary.{base,variant}.{forget,retain}`` (``mean_nll``,
    ``exact_match``, ``n``) and ``records`` (per probe, in request order, both models).
    """
    probes = {split: [p.model_dump() for p in getattr(body, split)] for split in evaluation.SPLITS}
    job = evaluation.submit_evaluation(ctx, variant_id, probes, body.callback_url)
    return _maybe_wait(ctx, job, wait, response)


@router.post("/variants/{variant_id}/generate", response_model=Job, status_code=202)
def generate(variant_id: str, body: GenerateRequest, ctx: ContextDep, response: Response, wait: WaitQuery = 0) -> Any:
    """Greedy continuation of ``prompt`` by the variant and/or its base: ``result.outputs.{base,variant}.text``."""
    job = evaluation.submit_generation(ctx, variant_id, body.prompt, body.max_new_tokens, body.models, body.callback_url)
    return _maybe_wait(ctx, job, wait, response)
