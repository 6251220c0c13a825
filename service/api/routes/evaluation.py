"""Evaluation and generation on a variant: jobs, optionally awaited for a few seconds."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from starlette.concurrency import run_in_threadpool

from api_schemas import EvaluateRequest, GenerateRequest, Job
from api_schemas.provenance import MetadataFields
from service.api.deps import ContextDep, LanesDep
from service.api.lanes import Lanes
from service.context import Context
from service.evaluation import service as evaluation
from service.jobs.store import FINISHED, job_answer
from service.variants.service import refuse_gguf_loading

router = APIRouter(tags=["evaluation"])
WaitQuery = Annotated[
    float, Query(ge=0, le=60, description="wait up to this many seconds: 200 with the finished job, else 202")
]


async def _submit_and_wait(ctx: Context, lanes: Lanes, wait: float, response: Response, submit: Any, *args: Any) -> Job:
    """Submit in a worker thread, then wait on the event loop (no thread held) when asked to."""
    if wait <= 0:
        job = await run_in_threadpool(submit, ctx, *args)
    else:
        lanes.admit_waiter()  # 429 before anything is submitted
        try:
            job = await run_in_threadpool(submit, ctx, *args)
        except BaseException:
            lanes.waiting -= 1
            raise
        job = await lanes.wait_for_job(ctx, job, wait)
    response.status_code = 200 if job.status in FINISHED else 202
    return job_answer(job)


@router.post("/variants/{variant_id}/evaluate", response_model=Job, status_code=202)
async def evaluate(
    variant_id: str, body: EvaluateRequest, ctx: ContextDep, lanes: LanesDep, response: Response, wait: WaitQuery = 0
) -> Any:
    """Answer NLL and greedy exact match per probe, for the base model and the variant.

    The job's ``result`` holds ``summary.{base,variant}.{forget,retain}`` (``mean_nll``,
    ``exact_match``, ``n``) and ``records`` (per probe, in request order, both models). With
    ``metrics`` (``"tofu"`` or a list of names), also ``tofu.{base,variant,retain}``: TOFU's raw
    values and scores as OpenUnlearning names them, and what was left out and why (``retain``, and
    the scores against the retain model, only with ``retain_model``).

    An image classifier's variant takes labelled image probes (``{"image", "label"}``) in
    ``forget``, ``retain`` and ``test``: ``summary`` and ``records`` then hold the label's NLL and
    whether the top-1 class is the label, and ``classifier`` per model (base, variant, and the
    ``retain_model`` as ``retrained``) and set the top-1 accuracy, the mean label NLL and the
    confusion row of each forgotten class, the features' DA and NMI, and the variant's ToW and CKA
    to the base and to the retrained model.

    The same probes and options on the same variant, from any key, answer the job queued or running
    for them, or the finished job whose result is stored: no second job, and no 429 for it.

    ``labels`` and ``reason`` are stored with the result, beside ``created_at``, ``created_by`` (the
    key's fingerprint) and ``probe_sets`` (each set's sha256 and size): they are no part of the
    evaluation's identity, so an identical later request is answered with the first request's.
    """
    await run_in_threadpool(refuse_gguf_loading, ctx, [variant_id, body.retain_model], "evaluation")
    args = (variant_id, *_evaluation_args(body))
    return await _submit_and_wait(ctx, lanes, wait, response, evaluation.submit_evaluation, *args)


def _evaluation_args(body: EvaluateRequest) -> tuple[Any, ...]:
    """``submit_evaluation``'s arguments after the variant: probes, callback, TOFU options, retain
    model (image probes), attacks and the request's metadata (kept with the result, not its identity)."""
    meta = MetadataFields(labels=body.labels, reason=body.reason)
    # exclude_none: a prompt/completion probe is stored (and digested) as it always was.
    sets = (*evaluation.SPLITS, "test")
    probes = {split: [p.model_dump(exclude_none=True) for p in getattr(body, split)] for split in sets}
    if body.kind == "image":
        return probes, body.callback_url, None, body.retain_model, None, meta
    tofu = None
    if body.metrics is not None:
        tofu = {
            "metrics": body.metrics,
            "retain_model": body.retain_model,
            "holdout": [p.model_dump(exclude_none=True) for p in body.holdout],
            "utility": {name: [p.model_dump(exclude_none=True) for p in items] for name, items in body.utility.items()},
        }
    attacks = [attack.model_dump(mode="json", exclude_none=True) for attack in body.attacks]  # with defaults: identity
    return probes, body.callback_url, tofu, None, attacks, meta


@router.post("/variants/{variant_id}/generate", response_model=Job, status_code=202)
async def generate(
    variant_id: str, body: GenerateRequest, ctx: ContextDep, lanes: LanesDep, response: Response, wait: WaitQuery = 0
) -> Any:
    """Greedy continuation of ``prompt`` by the variant and/or its base: ``result.outputs.{base,variant}.text``.

    ``messages`` instead of ``prompt``: the conversation rendered with the model's chat template and
    its generation prompt is continued. An identical request, from any key, answers the job queued or
    running for it (no second job, and no 429 for it); once that job has finished, it runs again."""
    await run_in_threadpool(refuse_gguf_loading, ctx, [variant_id] if "variant" in body.models else [], "generation")
    return await _submit_and_wait(
        ctx,
        lanes,
        wait,
        response,
        evaluation.submit_generation,
        variant_id,
        body.prompt,
        body.max_new_tokens,
        body.models,
        body.callback_url,
        [m.model_dump() for m in body.messages] if body.messages is not None else None,
    )
