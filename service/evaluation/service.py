"""Submitting an evaluation or a generation: both are jobs, because they run the model.

In distributed mode they go to the ``gpu`` queue like collections, in embedded mode to their own
lane; the job bodies are :mod:`service.evaluation.run`. Evaluation results are content-addressed
(``evaluations/<variant, probes digest>.json``): the same probes on the same variant are answered
from storage. An identical request (evaluation or generation, from any key that may submit one)
follows the job queued or running for it, or for an evaluation the job that stored its result,
instead of starting another (:func:`service.jobs.submit.follow_or_start`): admission control
counts no new work for it.

Image probes (``{"image", "label"}``) go to an image classifier's variant only: every image is
decoded under ``ENGRAM_MAX_IMAGE_PIXELS`` and every label resolved against the model's classes at
submission (:mod:`service.evaluation.classifier_probes`), and the job is
:mod:`service.evaluation.classifier_run`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from api_schemas import Variant
from api_schemas.evaluation import Split
from api_schemas.provenance import MetadataFields
from service.context import Context
from service.errors import Conflict, InvalidInput, NotFound
from service.evaluation.classifier_probes import check_image_probes, check_probe_kinds, model_classes, retain_classifier
from service.evaluation.records import ClassifierOptions, StoredProbes, TofuOptions
from service.evaluation.retain_model import RetainModelRef
from service.jobs import callbacks
from service.jobs.records import EvaluatePayload, GeneratePayload, JobRecord
from service.jobs.store import new_job
from service.jobs.submit import follow_or_start
from service.models.record import ModelRecord
from service.models.registry import check_causal_lm, check_chat_templates, find_model, get_model
from service.storage.keys import (
    canonical_digest,
    evaluation_key,
    evaluation_request_key,
    generation_request_key,
    probes_key,
)
from service.variants.service import find_variant_request, variant_view

SPLITS: tuple[Split, ...] = ("forget", "retain")  # a text evaluation's probe sets
METRICS_ALL = "tofu"


def _ready_view(ctx: Context, variant_id: str) -> Variant:
    view = variant_view(ctx, variant_id)  # 404 for an unknown variant
    if view.status != "ready":
        raise Conflict(f"variant {variant_id} is {view.status}, not ready; wait for its job {view.job_id}")
    return view


def _ready_variant(ctx: Context, variant_id: str) -> Variant:
    view = _ready_view(ctx, variant_id)
    check_causal_lm(get_model(ctx, view.model_id), "evaluation and generation")
    return view


def submit_evaluation(
    ctx: Context,
    variant_id: str,
    probes: dict[str, list[dict[str, Any]]],
    callback_url: str | None,
    tofu: Mapping[str, Any] | None = None,
    retain_model: str | None = None,
    attacks: list[dict[str, Any]] | None = None,
    meta: MetadataFields | None = None,
) -> JobRecord:
    """Store the probes and queue an evaluation job; returns the job.

    ``meta`` (the request's labels and reason) rides in the job's payload and is stored with the
    result, not with the probes: it is no part of the evaluation's identity, so an identical request
    is answered with the first request's evaluation, its labels and reason included.

    ``tofu`` (the request's ``metrics``, ``retain_model``, ``holdout``, ``utility``; None without
    metrics) is stored with the probes, so it is part of the evaluation's identity: the same probes
    asked for other metrics or against another retain model are scored again, not answered from storage.

    Image probes (an image classifier's variant; ``probes`` may hold a ``test`` set) are checked by
    :func:`_classifier_probes`, with ``retain_model`` the retrained classifier.
    """
    urls = callbacks.check_optional_url(callback_url, ctx.settings)
    view = _ready_view(ctx, variant_id)
    model = get_model(ctx, view.model_id)
    check_probe_kinds(probes, model)  # before the causal-LM check: it names the probe and the model's kind
    if model.kind == "image":
        return _queue(ctx, variant_id, _classifier_probes(ctx, model, probes, retain_model), urls, meta)
    check_causal_lm(model, "evaluation and generation")
    # Only the options asked for are stored: an evaluation without metrics is identified by its probes alone.
    stored = StoredProbes(forget=probes.get("forget", []), retain=probes.get("retain", []))
    if tofu is not None:
        stored = StoredProbes(forget=stored.forget, retain=stored.retain, tofu=_tofu_options(ctx, view, tofu))
    if attacks:  # stored with the probes, so they are part of the evaluation's identity
        stored = stored.model_copy(update={"attacks": attacks})
        if any(a.get("form") == "chat_template" for a in attacks):
            _check_chat_template(ctx, view, "attack rephrase:chat_template")
    every_probe = [*stored.forget, *stored.retain]
    if stored.tofu is not None:
        every_probe += [*stored.tofu.holdout, *(p for items in stored.tofu.utility.values() for p in items)]
    if any("messages" in p for p in every_probe):
        _check_chat_template(ctx, view, "messages probes")
    return _queue(ctx, variant_id, stored, urls, meta)


def _classifier_probes(
    ctx: Context, model: ModelRecord, probes: dict[str, list[dict[str, Any]]], retain_model: str | None
) -> StoredProbes:
    """The stored form of an image classifier's evaluation: its probe sets as sent (every image
    checked whole from its file and every label resolved here, so the job meets no probe it cannot read) and the
    resolved retrained model (``classifier.retain_model``; None without one)."""
    check_image_probes(probes, model_classes(model), ctx.settings.max_image_pixels)
    retained = retain_classifier(ctx, model, retain_model) if retain_model is not None else None
    return StoredProbes(
        forget=probes.get("forget", []),
        retain=probes.get("retain", []),
        test=probes.get("test", []),
        classifier=ClassifierOptions(retain_model=retained),
    )


def _queue(ctx: Context, variant_id: str, stored: StoredProbes, urls: list[str], meta: MetadataFields | None) -> JobRecord:
    """The evaluation's job: the one queued or running for the same probes on the same variant, or
    the one that stored its result; else a new one, after the probes are stored (content-addressed)."""
    data = stored.to_bytes()
    digest = hashlib.sha256(data).hexdigest()
    evaluation_id = canonical_digest({"variant_id": variant_id, "probes": digest})[:32]
    labels, reason = (dict(meta.labels or {}), meta.reason) if meta is not None else ({}, None)
    payload = EvaluatePayload(
        variant_id=variant_id, probes_digest=digest, evaluation_id=evaluation_id, labels=labels, reason=reason
    )
    return follow_or_start(
        ctx,
        evaluation_request_key(evaluation_id),
        lambda: new_job("evaluate", payload, unit="probes", callback_urls=urls),
        urls,
        answers=lambda job: job.status == "succeeded" and ctx.storage.exists(evaluation_key(evaluation_id)),
        prepare=lambda: ctx.storage.put_bytes(probes_key(digest), data),  # before the job: the task reads it
    )


def _tofu_options(ctx: Context, view: Variant, tofu: Mapping[str, Any]) -> TofuOptions:
    """The stored TOFU options, with the retain model resolved (:class:`RetainModelRef`)."""
    retain_id = tofu.get("retain_model")
    return TofuOptions(
        metrics=tofu["metrics"],
        holdout=list(tofu.get("holdout") or []),
        utility={name: list(items) for name, items in (tofu.get("utility") or {}).items()},
        retain_model=resolve_retain_model(ctx, view.model_id, retain_id) if retain_id is not None else None,
    )


def resolve_retain_model(ctx: Context, model_id: str, retain_id: str) -> RetainModelRef:
    """A registered model or a ready variant, a causal LM with the base model's vocabulary (that of
    ``model_id``); its reference names its checkpoint digest, or the variant id, which names its
    content, so a re-registered retain model is a new evaluation.

    Raises:
        NotFound: neither a registered model nor a variant has this id.
        Conflict: a variant that is not ready.
        InvalidInput: not a causal LM, or another vocabulary than the base model's.
    """
    base = get_model(ctx, model_id)
    manifest = find_model(ctx, retain_id)
    if manifest is not None:
        check_causal_lm(manifest, "a retain model's metrics")
        _check_same_vocabulary(base, manifest)
        return RetainModelRef(id=retain_id, kind="model", digest=manifest.digest)
    if find_variant_request(ctx, retain_id) is None:
        raise NotFound(f"retain_model {retain_id} is neither a registered model nor a variant")
    retain_view = _ready_variant(ctx, retain_id)
    _check_same_vocabulary(base, get_model(ctx, retain_view.model_id))
    return RetainModelRef(id=retain_id, kind="variant", digest=retain_id)


def _check_same_vocabulary(base: ModelRecord, retain: ModelRecord) -> None:
    """422 when the retain model's tokenizer has another vocabulary than the base model's: the
    metrics compare both models' probabilities of the same tokens. A folder this process cannot read
    is left to the job, which checks the same."""
    if base.digest == retain.digest:
        return
    from service.engine.checkpoint import load_tokenizer  # transformers: only when a check is needed

    try:
        base_vocab = load_tokenizer(Path(base.path)).get_vocab()
        retain_vocab = load_tokenizer(Path(retain.path)).get_vocab()
    except (OSError, ValueError):
        return
    if base_vocab != retain_vocab:
        raise InvalidInput(
            f"retain_model {retain.model_id} has another tokenizer vocabulary ({len(retain_vocab)} tokens) than the "
            f"base model {base.model_id} ({len(base_vocab)} tokens): the metrics compare the same tokens' probabilities"
        )


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
    # Greedy decoding of a content-addressed variant: the same payload gives the same text, so an
    # identical request follows the job queued or running for it. A finished one is not followed:
    # no generation result is stored by content (evaluations are), so a later request runs anew.
    generation_id = canonical_digest(payload.model_dump(mode="json"))[:32]

    def start() -> JobRecord:
        return new_job("generate", payload, unit="models", callback_urls=urls)

    return follow_or_start(ctx, generation_request_key(generation_id), start, urls)


def _check_chat_template(ctx: Context, view: Variant, what: str) -> None:
    """422 when the variant's model has no chat template (read from its tokenizer files)."""
    check_chat_templates({view.model_id: get_model(ctx, view.model_id)}, what)
