"""Submitting an evaluation or a generation: both are jobs, because they run the model.

In distributed mode they go to the ``gpu`` queue like collections, in embedded mode to their own
lane; the job bodies are :mod:`service.evaluation.run`. Evaluation results are content-addressed
(``evaluations/<variant, probes digest>.json``): the same probes on the same variant are answered
from storage.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from service.context import Context
from service.errors import Conflict
from service.jobs import callbacks
from service.jobs.admission import admit
from service.jobs.records import EvaluatePayload, GeneratePayload, JobRecord
from service.jobs.store import new_job
from service.models.registry import check_causal_lm, check_chat_templates, get_model
from service.storage.keys import canonical_digest, probes_key
from service.variants.service import variant_view

SPLITS = ("forget", "retain")


def _ready_variant(ctx: Context, variant_id: str) -> dict[str, Any]:
    view = variant_view(ctx, variant_id)  # 404 for an unknown variant
    if view["status"] != "ready":
        raise Conflict(f"variant {variant_id} is {view['status']}, not ready; wait for its job {view['job_id']}")
    check_causal_lm(get_model(ctx, view["model_id"]), "evaluation and generation")
    return view


def submit_evaluation(
    ctx: Context, variant_id: str, probes: dict[str, list[dict[str, str]]], callback_url: str | None
) -> JobRecord:
    """Store the probes and queue an evaluation job; returns the job."""
    urls = callbacks.check_optional_url(callback_url, ctx.settings)
    view = _ready_variant(ctx, variant_id)
    if any("messages" in p for split in SPLITS for p in probes.get(split, [])):
        _check_chat_template(ctx, view, "messages probes")
    data = json.dumps({s: probes.get(s, []) for s in SPLITS}, sort_keys=True, ensure_ascii=False).encode()
    digest = hashlib.sha256(data).hexdigest()
    payload = EvaluatePayload(
        variant_id=variant_id,
        probes_digest=digest,
        evaluation_id=canonical_digest({"variant_id": variant_id, "probes": digest})[:32],
    )
    with ctx.lock:  # admission counts and the job it admits, together
        admit(ctx)  # before the probes are stored: a refusal writes nothing
        ctx.storage.put_bytes(probes_key(digest), data)  # before the job: the task reads it
        job = ctx.jobs.create(new_job("evaluate", payload, unit="probes", callback_urls=urls))
    ctx.dispatch(job)
    return job


def submit_generation(
    ctx: Context,
    variant_id: str,
    prompt: str | None,
    max_new_tokens: int,
    models: Sequence[str],
    callback_url: str | None,
    messages: list[dict[str, str]] | None = None,
) -> JobRecord:
    """Queue a greedy generation from ``prompt`` (or from ``messages`` rendered with the chat template
    and its generation prompt) on the variant and/or its base; returns the job."""
    urls = callbacks.check_optional_url(callback_url, ctx.settings)
    view = _ready_variant(ctx, variant_id)
    if messages is not None:
        _check_chat_template(ctx, view, "messages")
    payload = GeneratePayload(
        variant_id=variant_id, prompt=prompt, max_new_tokens=max_new_tokens, models=list(models), messages=messages
    )
    with ctx.lock:  # admission counts and the job it admits, together
        admit(ctx)
        job = ctx.jobs.create(new_job("generate", payload, unit="models", callback_urls=urls))
    ctx.dispatch(job)
    return job


def _check_chat_template(ctx: Context, view: dict[str, Any], what: str) -> None:
    """422 when the variant's model has no chat template (read from its tokenizer files)."""
    check_chat_templates({view["model_id"]: get_model(ctx, view["model_id"])}, what)
