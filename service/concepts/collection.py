"""The ``collect`` job body: one concept's statistics on one model, published content-addressed.

A concept posted with a dataset reference has no dataset yet: the job resolves the reference first
(streams it into ``datasets/<digest>.jsonl`` and records the digest on the concept), then collects
as for any other dataset. Statistics that already exist are not collected again.

Records longer than ``max_length`` tokens are truncated, and the job says so: its result (and the
statistics manifest, so that a reuse says the same) gives the records read, those truncated (how
many, the tokens cut, the first indices) and those left without a counted token (a completion or
assistant turn wholly beyond the limit adds nothing to the statistics). A dataset is never
shortened silently.

Bounds. Every text is cut to a character budget before it is tokenized (a record of any size costs
bounded memory; :mod:`service.engine.record_budget`), chat templates render in a child process
bounded by ENGRAM_TEMPLATE_TIMEOUT_S / _MEMORY_BYTES / _MAX_CHARS, and cancellation is checked in
every phase: resolution (per chunk read), the first pass (every half second), each template render
(every 0.1 s), each batch, and before publication. What no check can reach (native code) embedded
mode's executor ends by replacing the job process (ENGRAM_CANCEL_GRACE_S).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.concepts.image_collection import check_text_records, count_records, image_statistics
from service.concepts.record import ConceptRecord
from service.concepts.service import CHAT_KINDS, find_concept, iter_records
from service.context import Context
from service.datasets.refs import resolve_reference
from service.engine.checkpoint import ModelTooLarge
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.layers import select_layers
from service.engine.record_budget import char_budget
from service.engine.records import Batch, Example, RecordError, encode_record, make_batches, pad_token_id
from service.engine.stats_io import save_statistics
from service.engine.template_render import TemplateProcess
from service.errors import InvalidInput, JobFailed
from service.jobs.progress import JobCancelled, ProgressReporter
from service.jobs.records import CollectPayload, JobRecord
from service.jobs.results import CollectResult
from service.jobs.store import utc_now
from service.jobs.templates import template_limits
from service.models.loaded import MODELS, check_model_unchanged
from service.models.record import ModelRecord
from service.models.registry import get_model
from service.observability import record_collection
from service.statistics.key import STATISTICS_FILE
from service.statistics.manifest import StatisticsManifest, publish_statistics, stats_manifest
from service.statistics.spec import CollectionSpec
from service.storage.base import scratch_dir
from service.storage.keys import concept_key, dataset_key

log = logging.getLogger("engram.collection")


def run_collection(ctx: Context, job: JobRecord) -> CollectResult:
    """Collect one concept's statistics on one model (skipped when they already exist).

    A concept posted with a dataset reference has no dataset yet: the job resolves it first
    (:func:`_resolve_dataset`), then goes on as for any other dataset.
    """
    payload = job.payload_of(CollectPayload)
    if payload.dataset_digest is None:
        payload = _resolve_dataset(ctx, job.job_id, payload)
    dataset_digest = payload.dataset_digest
    assert dataset_digest is not None  # resolved above
    spec = CollectionSpec.of_job(payload.settings)
    prefix = spec.key(payload.model_digest, dataset_digest).prefix
    published = stats_manifest(ctx, prefix)
    if published is not None:
        # Reused statistics: the job is done with every token it would have counted (not "0/0").
        ctx.jobs.set_progress(job.job_id, published.tokens, published.tokens)
        return CollectResult.model_validate(
            {"tokens": published.tokens, "stats": prefix, "reused": True, **(published.truncation or {})}
        )
    manifest = get_model(ctx, payload.model_id)
    if manifest.digest != payload.model_digest:
        raise JobFailed(f"model {payload.model_id} was re-registered with other weights")
    MODELS.capacity = ctx.settings.model_cache_size
    # The model may run in bfloat16 (ENGRAM_COLLECT_DTYPE); the covariances still accumulate in
    # float32 products and float64 sums (see service.engine.collect).
    dtype = spec.collect_dtype
    # ENGRAM_DEVICE_MAP=auto: a model bigger than one GPU is spread over the node's GPUs (and the
    # CPU); each layer's accumulators stay on its device, the statistics are the same.
    device_map = None if ctx.settings.device_map == "none" else ctx.settings.device_map
    try:
        model, tokenizer = MODELS.get(ctx, manifest, ctx.settings.torch_device, dtype, device_map)
    except ModelTooLarge as exc:
        raise JobFailed(str(exc)) from None
    if manifest.kind == "image":  # pixel batches, not tokens (service.concepts.image_collection)
        return _collect_images(ctx, job.job_id, payload, manifest, model, spec, prefix)
    max_length, template = spec.max_length, spec.template
    cancelled = cancel_check(ctx, job.job_id)
    # Every text is cut to this many characters before it is tokenized: a record of any size costs
    # bounded memory, and one within the budget is tokenized exactly as before (record_budget.py).
    budget = char_budget(tokenizer, max_length)
    with scratch_dir("collect") as tmp, TemplateProcess(template_limits(ctx.settings), cancelled) as renderer:
        # The stored dataset is read from a local file one line at a time, twice: once to count the
        # tokens that enter the statistics, once in chunks to collect them (no whole dataset in memory).
        path = _local_dataset(ctx, dataset_digest, Path(tmp))
        first_row = _first_row(ctx, payload)
        check_text_records(path, payload.model_id, first_row)  # a reference's image records, named

        def examples() -> Iterator[Example]:
            for i, record in enumerate(iter_records(path)):
                try:
                    where = i if first_row is None else f"dataset row {first_row + i}"
                    yield encode_record(
                        tokenizer, record, max_length, template, index=where, budget=budget, renderer=renderer
                    )
                except RecordError as exc:
                    raise JobFailed(_chat_problem(str(exc), payload.model_id)) from None

        survey = Survey.of(examples(), max_length, cancelled)
        if survey.tokens == 0:
            raise JobFailed(survey.nothing_counted())
        if survey.truncated:
            log.warning("collection of %s: %s", payload.concept, survey.report())
        progress = ProgressReporter(ctx, job.job_id, survey.tokens)
        layout = manifest.layout
        # A concept posted with modules collects only those layers' input groups.
        layers = select_layers(layout.layers, spec.module_list)
        started = time.monotonic()
        stats = collect_statistics(
            model,
            _chunked_batches(examples(), ctx.settings.collect_batch_size, pad_token_id(tokenizer)),
            layers,
            on_batch=progress.advance,
            should_stop=progress.cancelled,
        )
    seconds = time.monotonic() - started
    record_collection(stats.tokens, seconds)
    report = survey.report()
    check_model_unchanged(ctx, manifest)  # the mapped weights were not rewritten while they ran (issue 23, 7)
    _publish_statistics(ctx, prefix, stats, payload, spec, seconds, report, cancelled)
    return CollectResult.model_validate(
        {"tokens": stats.tokens, "stats": prefix, "reused": False, "seconds": round(seconds, 3), **report}
    )


def _collect_images(
    ctx: Context, job_id: str, payload: CollectPayload, manifest: ModelRecord, model: Any, spec: CollectionSpec, prefix: str
) -> CollectResult:
    """An image concept on an image classifier: every image counts whole (nothing to truncate);
    progress counts images."""
    assert payload.dataset_digest is not None  # resolved before anything is collected
    cancelled = cancel_check(ctx, job_id)
    with scratch_dir("collect") as tmp:
        path = _local_dataset(ctx, payload.dataset_digest, Path(tmp))
        records = count_records(path)
        progress = ProgressReporter(ctx, job_id, records)
        started = time.monotonic()
        stats = image_statistics(
            model,
            Path(manifest.path),
            path,
            select_layers(manifest.layout.layers, spec.module_list),
            batch_size=ctx.settings.collect_batch_size,
            max_pixels=ctx.settings.max_image_pixels,
            first_row=_first_row(ctx, payload),
            on_batch=progress.advance,
            should_stop=progress.cancelled,
        )
    seconds = time.monotonic() - started
    record_collection(stats.tokens, seconds)
    check_model_unchanged(ctx, manifest)  # the mapped weights were not rewritten while they ran
    report = Survey(spec.max_length, records=records).report()  # an image is never cut: none truncated
    _publish_statistics(ctx, prefix, stats, payload, spec, seconds, report, cancelled)
    return CollectResult.model_validate(
        {"tokens": stats.tokens, "stats": prefix, "reused": False, "seconds": round(seconds, 3), **report}
    )


FIRST_LISTED = 10  # record indices a truncation report lists


@dataclass
class Survey:
    """What ``max_length`` did to a dataset: the counted tokens, the records it truncated and those
    it left without a counted token (which then add nothing to the statistics)."""

    max_length: int
    records: int = 0
    tokens: int = 0
    truncated: int = 0
    cut_tokens: int = 0
    uncounted: int = 0
    first_truncated: list[int] = field(default_factory=list)
    first_uncounted: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, examples: Iterable[Example], max_length: int, should_stop: Callable[[], bool] | None = None) -> Survey:
        """One pass over the tokenized records, stopping when ``should_stop`` says so (a large
        dataset's first pass takes minutes: a cancellation must not wait for its end).

        Raises:
            JobCancelled: ``should_stop`` returned True.
        """
        survey = cls(max_length)
        for index, example in enumerate(examples):
            if should_stop is not None and should_stop():
                raise JobCancelled()
            survey.add(index, example)
        return survey

    def add(self, index: int, example: Example) -> None:
        counted = sum(example.counted)
        self.records += 1
        self.tokens += counted
        if example.cut:
            self.truncated += 1
            self.cut_tokens += example.cut
            if len(self.first_truncated) < FIRST_LISTED:
                self.first_truncated.append(index)
        if counted == 0:
            self.uncounted += 1
            if len(self.first_uncounted) < FIRST_LISTED:
                self.first_uncounted.append(index)

    def report(self) -> dict[str, Any]:
        """The job result's and the manifest's account of it."""
        return {
            "records": self.records,
            "truncated": {
                "max_length": self.max_length,
                "records": self.truncated,
                "tokens": self.cut_tokens,
                "first": self.first_truncated,
            },
            "uncounted": {"records": self.uncounted, "first": self.first_uncounted},
        }

    def nothing_counted(self) -> str:
        """Why a dataset without a counted token fails, naming the setting when truncation is why."""
        if self.truncated:
            return (
                "no record has a token that enters the statistics: the counted tokens (completions, assistant "
                f"turns) lie beyond max_length {self.max_length} (ENGRAM_MAX_LENGTH) in every record "
                f"({self.truncated} of {self.records} truncated)"
            )
        return "no record has a token that enters the statistics"


SORT_CHUNK = 8192  # examples sorted by length together (a batch wastes little on padding)


def _chunked_batches(examples: Iterable[Example], batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Right-padded batches of ``examples``, sorted by length within chunks of :data:`SORT_CHUNK`
    (a dataset up to that size gives exactly the batches ``make_batches`` gives for it whole)."""
    chunk: list[Example] = []
    for example in examples:
        chunk.append(example)
        if len(chunk) == SORT_CHUNK:
            yield from make_batches(chunk, batch_size, pad_id)
            chunk = []
    if chunk:
        yield from make_batches(chunk, batch_size, pad_id)


CANCEL_CHECK_S = 0.5  # how often a collection's loops read the job record for a cancellation


class CancelCheck:
    """Whether the job was cancelled, read from its record at most every :data:`CANCEL_CHECK_S`
    (a loop over records may call it for each one)."""

    def __init__(self, ctx: Context, job_id: str) -> None:
        self.ctx, self.job_id, self._last = ctx, job_id, 0.0

    def __call__(self, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._last < CANCEL_CHECK_S:
            return False
        self._last = now
        job = self.ctx.jobs.get(self.job_id)
        return bool(job and job.cancel_requested)


def cancel_check(ctx: Context, job_id: str) -> CancelCheck:
    return CancelCheck(ctx, job_id)


def _local_dataset(ctx: Context, digest: str, directory: Path) -> Path:
    """A local file holding the stored dataset: storage's own file, or a download into ``directory``."""
    key = dataset_key(digest)
    local = ctx.storage.local_path(key)
    if local is not None and local.is_file():
        return local
    target = directory / "dataset.jsonl"
    ctx.storage.download(key, target)
    return target


def _first_row(ctx: Context, payload: CollectPayload) -> int | None:
    """The source row of a dataset reference's first record (``rows.start``), so that a message names
    record ``i`` as the row the user finds in their file (``None``: records posted inline or
    uploaded, named ``record i``)."""
    reference = payload.dataset
    if reference is None:
        concept = find_concept(ctx, payload.concept)
        reference = concept.dataset if concept is not None else None
    if reference is None:
        return None
    return reference.start


def _chat_problem(message: str, model_id: str) -> str:
    """A record's chat problem as the job says it: naming the model when it has no chat template."""
    if "has no chat template" in message:
        return (
            f"model {model_id} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json), "
            f"which {CHAT_KINDS} need ({message})"
        )
    return message


def _resolve_dataset(ctx: Context, job_id: str, payload: CollectPayload) -> CollectPayload:
    """Resolve the concept's dataset reference: stream it into ``datasets/<digest>.jsonl`` (unless
    another model's job did already) and record the digest on the concept; the payload with it.

    Nothing is stored when the reference is bad: the records are spooled in a scratch folder and
    published only once all of them passed.

    Raises:
        ProblemError: a bad reference or a limit (the job fails with it; the concept shows it).
        JobFailed: the concept was deleted, or its dataset changed while it was being resolved.
    """
    name, model_id, reference = payload.concept, payload.model_id, payload.dataset
    if reference is None:
        raise JobFailed(f"the collection of concept {name} on model {model_id} has neither a dataset nor a reference")
    concept = _own_concept(ctx, name, model_id, job_id)
    digest, num_records = concept.dataset_digest, concept.num_records
    if digest is None:
        cancelled = cancel_check(ctx, job_id)

        def check() -> None:
            if cancelled():
                raise JobCancelled()

        with scratch_dir("dataset") as tmp:
            spooled = resolve_reference(reference, ctx.settings, Path(tmp), check)
            if CollectionSpec.of_job(payload.settings).template == "chat" and "text" in spooled.kinds:
                raise InvalidInput(f'{reference.uri} holds text records, which template "chat" cannot render')
            key = dataset_key(spooled.digest)
            if not ctx.storage.exists(key):
                ctx.storage.put_file(key, spooled.path)
        digest, num_records = spooled.digest, spooled.num_records
        log.info("dataset %s resolved: %s records, digest %s", reference.uri, spooled.num_records, digest)
    payload = payload.model_copy(update={"dataset_digest": digest})
    with ctx.lock:
        concept = _own_concept(ctx, name, model_id, job_id)
        if concept.dataset_digest is None:
            assert num_records is not None, "resolved together with its digest"
            concept = concept.resolved(digest, num_records)
        elif concept.dataset_digest != digest:
            raise JobFailed(
                f"the dataset {reference.uri} changed while it was being resolved "
                f"(digest {concept.dataset_digest}, then {digest}); post the concept again under another name"
            )
        prefix = CollectionSpec.of_job(payload.settings).key(payload.model_digest, digest).prefix
        concept = concept.with_model(model_id, concept.models[model_id].model_copy(update={"stats": prefix}))
        ctx.storage.put_json(concept_key(name), concept.to_json())
        ctx.reads.forget(concept_key(name))
    return payload


def _own_concept(ctx: Context, name: str, model_id: str, job_id: str) -> ConceptRecord:
    concept = find_concept(ctx, name)
    entry = concept.models.get(model_id) if concept is not None else None
    if concept is None or entry is None or entry.job_id != job_id:
        raise JobFailed(f"concept {name} was deleted (or posted again) while its dataset was being resolved")
    return concept


def _publish_statistics(
    ctx: Context,
    prefix: str,
    stats: LayerStatistics,
    payload: CollectPayload,
    spec: CollectionSpec,
    seconds: float,
    report: dict[str, Any],
    cancelled: CancelCheck,
) -> None:
    with scratch_dir("stats") as tmp:
        file = Path(tmp) / STATISTICS_FILE
        assert payload.dataset_digest is not None  # resolved before anything is collected
        extra = {"model_digest": payload.model_digest, "dataset_digest": payload.dataset_digest}
        dtype = getattr(torch, spec.sums_dtype)
        save_statistics(stats, file, extra, dtype=dtype)
        if cancelled(force=True):  # the last point where stopping leaves nothing behind
            raise JobCancelled()
        publish_statistics(ctx, prefix, file, lambda: _manifest(stats, payload, seconds, report))


def _manifest(stats: LayerStatistics, payload: CollectPayload, seconds: float, report: dict[str, Any]) -> StatisticsManifest:
    """The published statistics' manifest (their format: :mod:`service.statistics.manifest`)."""
    return StatisticsManifest(
        tokens=stats.tokens,
        groups=len(stats.sums),
        layers=len(stats.layer_group),
        # Hooked layers without statistics (an edit that needs one is refused by name).
        lacking=tuple(stats.lacking),
        model_digest=payload.model_digest,
        dataset_digest=payload.dataset_digest,
        settings=payload.settings.dump(),
        collection_seconds=round(seconds, 3),
        truncation=report,  # what max_length did: a reuse of these statistics reports it too
        created_at=utc_now(),
    )
