"""Job bodies: the same functions run in the API process (embedded) and in Celery workers.

Each task takes a job ID, re-reads its inputs from storage, checks whether its output already
exists (a redelivered job then finishes at once), works in a private scratch directory, and
publishes content-addressed outputs with the manifest last. Nothing half-written is visible.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis.exceptions
import torch

from service.calibration.build import run_calibration
from service.dataset_refs import resolve_reference
from service.engine.checkpoint import ModelLayout, ModelTooLarge
from service.engine.collect import CollectionCancelled, LayerStatistics, collect_statistics
from service.engine.layers import select_layers
from service.engine.records import Batch, Example, RecordError, encode_record, make_batches, pad_token_id
from service.engine.stats_io import save_statistics
from service.engrams.store import FACTOR_CACHE, algebra_from_statistics
from service.errors import InvalidInput, JobFailed, ProblemError
from service.evaluation import run_evaluation, run_generation
from service.jobs import FINISHED, utc_now
from service.leases import worker_name
from service.local_copies import (
    STATS_CACHE,
    checked_model_dir,
    local_statistics_file,
    statistics,
    trim_disk_cache,
)
from service.model_cache import MODELS
from service.observability import job_context, record_collection
from service.progress import JobCancelled, JobProgress
from service.registry import (
    CHAT_KINDS,
    Context,
    canonical_digest,
    concept_key,
    find_concept,
    get_model,
    iter_records,
    stats_manifest,
    stats_prefix,
)
from service.storage.base import StorageUnavailable, scratch_dir
from service.universes.build import help_build_universe, run_universe
from service.variants.build import run_variant

# Re-exported for the callers that import them from here.
__all__ = ["FACTOR_CACHE", "STATS_CACHE", "JobCancelled", "JobProgress", "checked_model_dir", "run_job"]

log = logging.getLogger("engram.tasks")


# Errors worth a retry: the job's inputs are fine, a service it needs is briefly away.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    StorageUnavailable,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


def run_job(ctx: Context, job_id: str, *, raise_transient: bool = False) -> None:
    """Run one job to a final state; the outcome is in the job record.

    Args:
        ctx: storage, jobs and settings of this process.
        job_id: the job to run (a finished one is left alone: redelivery is harmless).
        raise_transient: re-raise a transient error (storage or Redis unreachable) after putting
            the job back to ``queued``, so the caller (Celery) can retry it with backoff.
    """
    job = ctx.jobs.get(job_id)
    if job is None or job["status"] in FINISHED:
        return
    if job["cancel_requested"]:
        ctx.jobs.update(job_id, status="cancelled", finished_at=utc_now())
        return
    ctx.jobs.update(job_id, status="running", started_at=utc_now(), error=None)
    try:
        with job_context(job_id), _heartbeat(ctx, job_id):
            log.info("%s job started", job["kind"])
            body = _BODIES.get(job["kind"]) or _inference_body(job["kind"])
            result = {**body(ctx, job), "worker": worker_name()}
            log.info("%s job succeeded", job["kind"])
    except (JobCancelled, CollectionCancelled):
        ctx.jobs.update(job_id, status="cancelled", finished_at=utc_now())
    except TRANSIENT_ERRORS as exc:
        if not raise_transient:
            _fail(ctx, job_id, JobFailed(f"a service was unreachable: {exc}").to_problem())
            return
        log.warning("job %s hit a transient error, to be retried: %s", job_id, exc)
        ctx.jobs.update(job_id, status="queued", persist=False)
        raise
    except ProblemError as exc:
        _fail(ctx, job_id, exc.to_problem())
    except Exception as exc:  # the job must end, and the user must read why
        log.error("job %s failed: %s", job_id, traceback.format_exc())
        problem = JobFailed(f"{type(exc).__name__}: {exc}").to_problem()
        problem.update(status=500, title="Internal error", type="https://engram.dev/problems/internal")
        _fail(ctx, job_id, problem)
    else:
        ctx.jobs.update(job_id, status="succeeded", result=result, finished_at=utc_now())


def run_universe_helper(ctx: Context, universe_id: str, job_id: str) -> None:
    """Help job ``job_id`` build universe ``universe_id``: compute the parts no one holds, then stop.

    A helper is not a job: it has no record and its failure fails nothing. Whatever it could not do
    (it failed, or its worker died and its lease expired) the job computes itself, and a job that
    ended or was cancelled stops its helpers at their next part or layer.
    """
    with job_context(job_id):
        try:
            done = help_build_universe(ctx, universe_id, job_id)
        except JobCancelled:
            log.info("universe %s: stopped helping, job %s ended", universe_id, job_id)
        except Exception as exc:  # the job redoes the part; say why here
            log.warning("universe %s: helper of job %s failed, the job takes over: %s", universe_id, job_id, exc)
        else:
            log.info("universe %s: helper of job %s done (%s)", universe_id, job_id, done)


def _inference_body(kind: str) -> Any:
    return {"evaluate": run_evaluation, "generate": run_generation}[kind]


@contextmanager
def _heartbeat(ctx: Context, job_id: str) -> Iterator[None]:
    """While the body runs, tell the reconciler this job's worker is alive (distributed mode)."""
    beat = getattr(ctx.jobs, "heartbeat", None)
    if beat is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                beat(job_id)
            except Exception as exc:  # Redis briefly away: the next beat may get through
                log.warning("heartbeat of job %s failed: %s", job_id, exc)
            stop.wait(max(1.0, ctx.settings.heartbeat_ttl_s / 4))

    thread = threading.Thread(target=loop, name=f"heartbeat-{job_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def _fail(ctx: Context, job_id: str, problem: dict[str, Any]) -> None:
    ctx.jobs.update(job_id, status="failed", error=problem, finished_at=utc_now())


# ---------------------------------------------------------------- collection


def run_collection(ctx: Context, job: dict[str, Any]) -> dict[str, Any]:
    """Collect one concept's statistics on one model (skipped when they already exist).

    A concept posted with a dataset reference has no dataset yet: the job resolves it first
    (:func:`_resolve_dataset`), then goes on as for any other dataset.
    """
    payload = job["payload"]
    if payload.get("dataset_digest") is None:
        payload = _resolve_dataset(ctx, job)
    prefix = stats_prefix(payload["model_digest"], payload["dataset_digest"], canonical_digest(payload["settings"]))
    published = stats_manifest(ctx, prefix)
    if published is not None:
        return {"tokens": published["tokens"], "stats": prefix, "reused": True}
    manifest = get_model(ctx, payload["model_id"])
    if manifest["digest"] != payload["model_digest"]:
        raise JobFailed(f"model {payload['model_id']} was re-registered with other weights")
    MODELS.capacity = ctx.settings.model_cache_size
    # The model may run in bfloat16 (ENGRAM_COLLECT_DTYPE); the covariances still accumulate in
    # float32 products and float64 sums (see service.engine.collect).
    dtype = payload["settings"].get("collect_dtype")
    # ENGRAM_DEVICE_MAP=auto: a model bigger than one GPU is spread over the node's GPUs (and the
    # CPU); each layer's accumulators stay on its device, the statistics are the same.
    device_map = None if ctx.settings.device_map == "none" else ctx.settings.device_map
    try:
        model, tokenizer = MODELS.get(ctx, manifest, ctx.settings.torch_device, dtype, device_map)
    except ModelTooLarge as exc:
        raise JobFailed(str(exc)) from None
    max_length = int(payload["settings"]["max_length"])
    template = payload["settings"].get("template")
    with scratch_dir("collect") as tmp:
        # The stored dataset is read from a local file one line at a time, twice: once to count the
        # tokens that enter the statistics, once in chunks to collect them (no whole dataset in memory).
        path = _local_dataset(ctx, payload["dataset_digest"], Path(tmp))

        def examples() -> Iterator[Example]:
            for i, record in enumerate(iter_records(path)):
                try:
                    yield encode_record(tokenizer, record, max_length, template, index=i)
                except RecordError as exc:
                    raise JobFailed(_chat_problem(str(exc), payload["model_id"])) from None

        progress = JobProgress(ctx, job["job_id"], sum(sum(e.counted) for e in examples()))
        if progress.total == 0:
            raise JobFailed("no record has a token that enters the statistics (empty completions after truncation?)")
        layout = ModelLayout.from_json(manifest["layout"])
        # A concept posted with modules collects only those layers' input groups.
        layers = select_layers(layout.layers, payload["settings"].get("modules"))
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
    _publish_statistics(ctx, prefix, stats, payload, seconds)
    return {"tokens": stats.tokens, "stats": prefix, "reused": False, "seconds": round(seconds, 3)}


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


def _local_dataset(ctx: Context, digest: str, directory: Path) -> Path:
    """A local file holding the stored dataset: storage's own file, or a download into ``directory``."""
    key = f"datasets/{digest}.jsonl"
    local = ctx.storage.local_path(key)
    if local is not None and local.is_file():
        return local
    target = directory / "dataset.jsonl"
    ctx.storage.download(key, target)
    return target


def _chat_problem(message: str, model_id: str) -> str:
    """A record's chat problem as the job says it: naming the model when it has no chat template."""
    if "has no chat template" in message:
        return (
            f"model {model_id} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json), "
            f"which {CHAT_KINDS} need ({message})"
        )
    return message


def _resolve_dataset(ctx: Context, job: dict[str, Any]) -> dict[str, Any]:
    """Resolve the concept's dataset reference: stream it into ``datasets/<digest>.jsonl`` (unless
    another model's job did already) and record the digest on the concept; the payload with it.

    Nothing is stored when the reference is bad: the records are spooled in a scratch folder and
    published only once all of them passed.

    Raises:
        ProblemError: a bad reference or a limit (the job fails with it; the concept shows it).
        JobFailed: the concept was deleted, or its dataset changed while it was being resolved.
    """
    payload = job["payload"]
    name, model_id = payload["concept"], payload["model_id"]
    concept = _own_concept(ctx, name, model_id, job["job_id"])
    digest, num_records = concept["dataset_digest"], concept["num_records"]
    if digest is None:
        progress = JobProgress(ctx, job["job_id"], 0)

        def check() -> None:
            if progress.cancelled():
                raise JobCancelled()

        with scratch_dir("dataset") as tmp:
            spooled = resolve_reference(payload["dataset"], ctx.settings, Path(tmp), check)
            if payload["settings"].get("template") == "chat" and "text" in spooled.kinds:
                raise InvalidInput(f'{payload["dataset"]["uri"]} holds text records, which template "chat" cannot render')
            key = f"datasets/{spooled.digest}.jsonl"
            if not ctx.storage.exists(key):
                ctx.storage.put_file(key, spooled.path)
        digest, num_records = spooled.digest, spooled.num_records
        log.info("dataset %s resolved: %s records, digest %s", payload["dataset"]["uri"], spooled.num_records, digest)
    payload = {**payload, "dataset_digest": digest}
    with ctx.lock:
        concept = _own_concept(ctx, name, model_id, job["job_id"])
        if concept["dataset_digest"] is None:
            concept["dataset_digest"], concept["num_records"] = digest, num_records
        elif concept["dataset_digest"] != digest:
            raise JobFailed(
                f"the dataset {payload['dataset']['uri']} changed while it was being resolved "
                f"(digest {concept['dataset_digest']}, then {digest}); post the concept again under another name"
            )
        concept["models"][model_id]["stats"] = stats_prefix(
            payload["model_digest"], digest, canonical_digest(payload["settings"])
        )
        ctx.storage.put_json(concept_key(name), concept)
        ctx.reads.forget(concept_key(name))
    return payload


def _own_concept(ctx: Context, name: str, model_id: str, job_id: str) -> dict[str, Any]:
    concept = find_concept(ctx, name)
    entry = concept["models"].get(model_id) if concept is not None else None
    if concept is None or entry is None or entry["job_id"] != job_id:
        raise JobFailed(f"concept {name} was deleted (or posted again) while its dataset was being resolved")
    return concept


def _publish_statistics(ctx: Context, prefix: str, stats: LayerStatistics, payload: dict[str, Any], seconds: float) -> None:
    with scratch_dir("stats") as tmp:
        file = Path(tmp) / "statistics.safetensors"
        extra = {"model_digest": payload["model_digest"], "dataset_digest": payload["dataset_digest"]}
        dtype = getattr(torch, payload["settings"].get("stats_dtype", "float64"))
        save_statistics(stats, file, extra, dtype=dtype)
        ctx.storage.put_file(prefix + "statistics.safetensors", file)
    manifest = {
        "tokens": stats.tokens,
        "groups": len(stats.sums),
        "layers": len(stats.layer_group),
        # Hooked layers without statistics (an edit that needs one is refused by name).
        "lacking": stats.lacking,
        "model_digest": payload["model_digest"],
        "dataset_digest": payload["dataset_digest"],
        "settings": payload["settings"],
        "collection_seconds": round(seconds, 3),
        "created_at": utc_now(),
    }
    ctx.storage.put_json(prefix + "manifest.json", manifest)


# ---------------------------------------------------------------- variants and universes

# Variant and universe bodies live in their domains (service.variants.build, service.universes.build).
_BODIES = {"collect": run_collection, "variant": run_variant, "universe": run_universe}
# A calibration runs its recommended variant's job inline, through this module's runner.
_BODIES["calibrate"] = lambda ctx, job: run_calibration(ctx, job, run_job)

# The names older callers (tests, bench, the memory-trace maps) use for helpers now in their domains.
_statistics, _local_statistics_file, _trim_disk_cache = statistics, local_statistics_file, trim_disk_cache
_algebra = algebra_from_statistics
