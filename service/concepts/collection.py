"""The ``collect`` job body: one concept's statistics on one model, as its plan says, published content-addressed.

The job reads its plan (:func:`service.concepts.plan.read_collection`: settings, statistics key,
layers, a reference's first row, all resolved at submission) and decides nothing again. A concept
posted with a dataset reference has no dataset yet: the job resolves the reference first (streams
it into ``datasets/<digest>.jsonl`` and records the digest on the concept). Statistics that already
exist are not collected again. Otherwise the stored dataset is read by one of two readers, text
records into token batches (:mod:`service.concepts.text_collection`) or image records into pixel
batches (:mod:`service.concepts.image_collection`), and whatever they collected is published the
one way (:func:`_publish`): the result and the statistics manifest give the records read and what
``max_length`` truncated (:class:`~service.concepts.collected.Survey`).

Cancellation is checked in every phase: resolution (per chunk read), the first pass (every half
second), each template render (every 0.1 s), each batch, and before publication. What no check can
reach (native code) embedded mode's executor ends by replacing the job process (ENGRAM_CANCEL_GRACE_S).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from service.concepts.collected import CancelCheck, Collected
from service.concepts.draw import draw_texts, spool_samples
from service.concepts.image_collection import collect_images
from service.concepts.plan import Collection, read_collection
from service.concepts.record import ConceptRecord
from service.concepts.service import find_concept
from service.concepts.text_collection import collect_texts
from service.context import Context
from service.datasets.refs import resolve_reference
from service.datasets.spool import SpooledDataset
from service.datasets.stored import local_dataset
from service.engine.checkpoint import ModelTooLarge
from service.engine.stats_io import save_statistics
from service.errors import InvalidInput, JobFailed
from service.jobs.progress import JobCancelled
from service.jobs.records import CollectPayload, JobRecord, StoredReference
from service.jobs.results import CollectResult
from service.jobs.store import utc_now
from service.models.loaded import check_model_unchanged, checked_model_files, loaded_model
from service.models.record import ModelRecord
from service.models.registry import get_model
from service.observability import record_collection
from service.statistics.key import STATISTICS_FILE
from service.statistics.manifest import StatisticsManifest, publish_statistics, stats_manifest
from service.storage.base import scratch_dir
from service.storage.keys import concept_key, dataset_key

log = logging.getLogger("engram.collection")


def run_collection(ctx: Context, job: JobRecord) -> CollectResult:
    """Collect one concept's statistics on one model as planned (answered from storage when they exist)."""
    collection = read_collection(ctx, job.payload_of(CollectPayload))
    if collection.payload.dataset_digest is None:
        collection = _resolve_dataset(ctx, job.job_id, collection)
    published = stats_manifest(ctx, collection.key.prefix)
    if published is not None:
        # Reused statistics: the job is done with every token it would have counted (not "0/0").
        ctx.jobs.set_progress(job.job_id, published.tokens, published.tokens)
        return CollectResult.model_validate(
            {"tokens": published.tokens, "stats": collection.key.prefix, "reused": True, **(published.truncation or {})}
        )
    manifest, loaded = _loaded_model(ctx, collection)
    cancelled = CancelCheck(ctx, job.job_id)
    with scratch_dir("collect") as tmp:
        path = local_dataset(ctx.storage, collection.key.dataset_digest, Path(tmp))
        layers = collection.layers(manifest.layout)
        if manifest.kind == "image":  # pixel batches, not tokens
            with checked_model_files(ctx, manifest) as files:  # this machine's folder, never manifest.path
                folder = files.folder
            collected = collect_images(ctx, job.job_id, collection, loaded[0], folder, path, layers)
        else:
            collected = collect_texts(ctx, job.job_id, collection, loaded, path, layers, cancelled)
    check_model_unchanged(ctx, manifest)  # the mapped weights were not rewritten while they ran
    return _publish(ctx, collection, collected, cancelled)


def _loaded_model(ctx: Context, collection: Collection) -> tuple[ModelRecord, tuple[Any, Any]]:
    """The model's record and the model loaded with its tokenizer (``None`` for an image model).

    Raises:
        JobFailed: the model was registered again with other weights since the submission, or it does
            not fit the device.
    """
    payload = collection.payload
    manifest = get_model(ctx, payload.model_id)
    if manifest.digest != payload.model_digest:
        raise JobFailed(f"model {payload.model_id} was re-registered with other weights")
    # The model may run in bfloat16 (ENGRAM_COLLECT_DTYPE); the covariances still accumulate in
    # float32 products and float64 sums (see service.engine.collect). ENGRAM_DEVICE_MAP=auto: a model
    # bigger than one GPU is spread over the node's GPUs (and the CPU); each layer's accumulators stay
    # on its device, the statistics are the same.
    device_map = None if ctx.settings.device_map == "none" else ctx.settings.device_map
    try:
        loaded = loaded_model(ctx, manifest, ctx.settings.torch_device, collection.spec.collect_dtype, device_map)
    except ModelTooLarge as exc:
        raise JobFailed(str(exc)) from None
    return manifest, loaded


def _publish(ctx: Context, collection: Collection, collected: Collected, cancelled: CancelCheck) -> CollectResult:
    """Publish what either reader collected under the plan's key; the job's result."""
    record_collection(collected.stats.tokens, collected.seconds)
    key = collection.key
    with scratch_dir("stats") as tmp:
        file = Path(tmp) / STATISTICS_FILE
        extra = {"model_digest": key.model_digest, "dataset_digest": key.dataset_digest}
        save_statistics(collected.stats, file, extra, dtype=getattr(torch, collection.spec.sums_dtype))
        if cancelled(force=True):  # the last point where stopping leaves nothing behind
            raise JobCancelled()
        publish_statistics(ctx, key.prefix, file, lambda: _manifest(collection, collected))
    seconds = round(collected.seconds, 3)
    return CollectResult.model_validate(
        {"tokens": collected.stats.tokens, "stats": key.prefix, "reused": False, "seconds": seconds, **collected.report}
    )


def _manifest(collection: Collection, collected: Collected) -> StatisticsManifest:
    """The published statistics' manifest (their format: :mod:`service.statistics.manifest`)."""
    stats, key = collected.stats, collection.key
    return StatisticsManifest(
        tokens=stats.tokens,
        groups=len(stats.sums),
        layers=len(stats.layer_group),
        # Hooked layers without statistics (an edit that needs one is refused by name).
        lacking=tuple(stats.lacking),
        model_digest=key.model_digest,
        dataset_digest=key.dataset_digest,
        settings=collection.spec.dump(),
        collection_seconds=round(collected.seconds, 3),
        truncation=collected.report,  # what max_length did: a reuse of these statistics reports it too
        created_at=utc_now(),
    )


def _resolve_dataset(ctx: Context, job_id: str, collection: Collection) -> Collection:
    """Resolve the concept's dataset reference: stream it into ``datasets/<digest>.jsonl`` (unless
    another model's job did already) and record the digest on the concept; the collection over it.

    Nothing is stored when the reference is bad: the records are spooled in a scratch folder and
    published only once all of them passed.

    Raises:
        ProblemError: a bad reference or a limit (the job fails with it; the concept shows it).
        JobFailed: the concept was deleted, or its dataset changed while it was being resolved.
    """
    payload = collection.payload
    name, model_id, reference = payload.concept, payload.model_id, payload.dataset
    if collection.plan.samples is not None:
        return _drawn_dataset(ctx, job_id, collection)
    if reference is None:
        raise JobFailed(f"the collection of concept {name} on model {model_id} has neither a dataset nor a reference")
    concept = _own_concept(ctx, name, model_id, job_id)
    digest, num_records = concept.dataset_digest, concept.num_records
    if digest is None:
        with scratch_dir("dataset") as tmp:
            spooled = _spooled(ctx, job_id, reference, collection.spec.template, Path(tmp))
        digest, num_records = spooled.digest, spooled.num_records
        log.info("dataset %s resolved: %s records, digest %s", reference.uri, num_records, digest)
    collection = collection.resolved(digest)
    _record_resolution(ctx, job_id, collection, reference.uri, num_records)
    return collection


def _drawn_dataset(ctx: Context, job_id: str, collection: Collection) -> Collection:
    """A samples concept's dataset: drawn with the model (:mod:`service.concepts.sampled`; progress:
    samples drawn of ``count``), published under its digest (unless these texts are stored already)
    and recorded on the concept; the collection over it."""
    sampling = collection.plan.samples
    assert sampling is not None, "only a samples concept's collection draws"
    concept = _own_concept(ctx, collection.payload.concept, collection.payload.model_id, job_id)
    digest, num_records = concept.dataset_digest, concept.num_records
    if digest is None:
        _, (model, tokenizer) = _loaded_model(ctx, collection)
        cancelled = CancelCheck(ctx, job_id)

        def drawn(count: int) -> None:
            ctx.jobs.set_progress(job_id, count, sampling.count)
            if cancelled():
                raise JobCancelled()

        texts = draw_texts(model, tokenizer, sampling, ctx.settings.collect_batch_size)
        with scratch_dir("samples") as tmp:
            spooled = spool_samples(texts, Path(tmp) / "samples.jsonl", ctx.settings, drawn)
            if not ctx.storage.exists(dataset_key(spooled.digest)):
                ctx.storage.put_file(dataset_key(spooled.digest), spooled.path)
        digest, num_records = spooled.digest, spooled.num_records
        log.info("samples of %s drawn: %s records, digest %s", collection.payload.concept, num_records, digest)
    collection = collection.resolved(digest)
    _record_resolution(ctx, job_id, collection, "samples", num_records)
    return collection


def _spooled(ctx: Context, job_id: str, reference: StoredReference, template: str | None, directory: Path) -> SpooledDataset:
    """The reference's records spooled into ``directory`` and published under their digest."""
    cancelled = CancelCheck(ctx, job_id)

    def check() -> None:
        if cancelled():
            raise JobCancelled()

    spooled = resolve_reference(reference, ctx.settings, directory, check)
    if template == "chat" and "text" in spooled.kinds:
        raise InvalidInput(f'{reference.uri} holds text records, which template "chat" cannot render')
    key = dataset_key(spooled.digest)
    if not ctx.storage.exists(key):
        ctx.storage.put_file(key, spooled.path)
    return spooled


def _record_resolution(ctx: Context, job_id: str, collection: Collection, uri: str, num_records: int | None) -> None:
    """The resolved digest and the statistics' prefix recorded on the concept, unless it changed meanwhile.

    Raises:
        JobFailed: the concept was deleted or posted again, or another job resolved other content.
    """
    name, model_id, key = collection.payload.concept, collection.payload.model_id, collection.key
    with ctx.lock:
        concept = _own_concept(ctx, name, model_id, job_id)
        if concept.dataset_digest is None:
            assert num_records is not None, "resolved together with its digest"
            concept = concept.resolved(key.dataset_digest, num_records)
        elif concept.dataset_digest != key.dataset_digest:
            raise JobFailed(
                f"the dataset {uri} changed while it was being resolved "
                f"(digest {concept.dataset_digest}, then {key.dataset_digest}); post the concept again under another name"
            )
        concept = concept.with_model(model_id, concept.models[model_id].model_copy(update={"stats": key.prefix}))
        ctx.storage.put_json(concept_key(name), concept.to_json())
        ctx.reads.forget(concept_key(name))


def _own_concept(ctx: Context, name: str, model_id: str, job_id: str) -> ConceptRecord:
    concept = find_concept(ctx, name)
    entry = concept.models.get(model_id) if concept is not None else None
    if concept is None or entry is None or entry.job_id != job_id:
        raise JobFailed(f"concept {name} was deleted (or posted again) while its dataset was being resolved")
    return concept
