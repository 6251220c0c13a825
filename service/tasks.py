"""Job bodies: the same functions run in the API process (embedded) and in Celery workers.

Each task takes a job ID, re-reads its inputs from storage, checks whether its output already
exists (a redelivered job then finishes at once), works in a private scratch directory, and
publishes content-addressed outputs with the manifest last. Nothing half-written is visible.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis.exceptions
import torch

from service.cache import ByteLRU
from service.engine.checkpoint import (
    CheckpointReader,
    ModelLayout,
    directory_digest,
    file_sha256,
    load_model,
    load_tokenizer,
    write_checkpoint,
    write_delta,
)
from service.engine.collect import CollectionCancelled, LayerStatistics, collect_statistics
from service.engine.compose import EditError, EngramAlgebra, layer_deltas, layer_editor, layer_scales
from service.engine.layers import select_layers
from service.engine.lora import layer_loras, write_adapter
from service.engine.model_files import SIDE_FILES, ModelSourceError, check_links
from service.engine.records import encode_record, make_batches, pad_token_id
from service.engine.stats_io import StatisticsFile, expand_statistics, save_statistics
from service.errors import JobFailed, ProblemError
from service.jobs import FINISHED, utc_now
from service.observability import job_context, record_collection
from service.registry import (
    Context,
    canonical_digest,
    file_fingerprint,
    get_model,
    load_records,
    stats_manifest,
    stats_prefix,
)
from service.sources import local_model_dir
from service.storage import StorageUnavailable, scratch_dir

log = logging.getLogger("engram.tasks")
_PROGRESS_EVERY_S = 1.0


# Errors worth a retry: the job's inputs are fine, a service it needs is briefly away.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    StorageUnavailable,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


class JobCancelled(RuntimeError):
    pass


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
            result = {**body(ctx, job), "worker": f"{socket.gethostname()}:{os.getpid()}"}
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


def _inference_body(kind: str) -> Any:
    from service.evaluation import run_evaluation, run_generation  # they use this module's model cache

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


class JobProgress:
    """Throttled progress reporting plus the cancellation check, shared by both task kinds."""

    def __init__(self, ctx: Context, job_id: str, total: int) -> None:
        self.ctx, self.job_id, self.done, self.total = ctx, job_id, 0, total
        self._last = 0.0
        ctx.jobs.update(job_id, progress={**ctx.jobs.get(job_id)["progress"], "done": 0, "total": total})

    def advance(self, amount: int = 1) -> None:
        self.done += amount
        now = time.monotonic()
        if now - self._last >= _PROGRESS_EVERY_S or self.done >= self.total:
            self._last = now
            self.ctx.jobs.set_progress(self.job_id, self.done, self.total)
        if self.cancelled():
            raise JobCancelled()

    def cancelled(self) -> bool:
        job = self.ctx.jobs.get(self.job_id)
        return bool(job and job["cancel_requested"])


# ---------------------------------------------------------------- models in memory


class ModelCache:
    """A small LRU of loaded models keyed by checkpoint digest (a worker reuses its model)."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ctx: Context, manifest: dict[str, Any], device: str, dtype: str | None = None) -> tuple[Any, Any]:
        """The model (in ``dtype``, default: as stored) and its tokenizer, loaded on first use."""
        key = f"{manifest['digest']}@{device}/{dtype or 'stored'}"
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            path = checked_model_dir(ctx, manifest)
            torch_dtype = getattr(torch, dtype) if dtype else None
            item = (load_model(path, device=device, dtype=torch_dtype), load_tokenizer(path))
            self._items[key] = item
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
            return item


MODELS = ModelCache()  # one per process: a worker keeps its last models loaded between jobs


_VERIFIED: dict[str, str] = {}  # local copy of a remote source -> its verified digest


def checked_model_dir(ctx: Context, manifest: dict[str, Any]) -> Path:
    """This process's directory of the model, after checking it holds the registered files.

    A ``file://`` model is read in place (its sizes and mtimes must be as registered). A remote
    one (``s3://``, ``hf://``) is fetched into this machine's cache, which need not be the API's,
    and its content digest checked once per process.

    Either way the folder passes :mod:`service.engine.model_files`' rules again first (no link
    leading out of it, plain shard names), so a link swapped in since registration fails the job
    before any file is read or copied.
    """
    model_id = manifest["model_id"]
    try:
        if manifest["source"].startswith("file://"):
            path = Path(manifest["path"])
            if not path.is_dir() or not _unchanged(path, manifest):
                raise JobFailed(f"the files of model {model_id} changed since registration; register it again")
            return path
        path = local_model_dir(manifest["source"], [], ctx.cache_dir, ctx.settings.s3_endpoint_url)
        digest = manifest["digest"]
        if _VERIFIED.get(str(path)) != digest:
            check_links(path)
            # Registrations made before the allowlist hashed every in-folder file: accept their digest too.
            if directory_digest(path) != digest and directory_digest(path, every_file=True) != digest:
                raise JobFailed(f"the source of model {model_id} changed since registration; register it again")
            _VERIFIED[str(path)] = digest
        return path
    except ModelSourceError as exc:
        raise JobFailed(f"the files of model {model_id} are refused: {exc}; register it again") from None


def _unchanged(path: Path, manifest: dict[str, Any]) -> bool:
    """Whether the files the service uses from ``path`` are as registered (sizes and mtimes).

    Raises:
        ModelSourceError: the folder breaks a rule of :mod:`service.engine.model_files`.
    """
    if path.resolve() != path:  # registered resolved: the folder, or a folder above it, became a link
        raise ModelSourceError("the model folder was replaced by a symbolic link")
    check_links(path)
    current = file_fingerprint(path)
    return current == _registered_fingerprint(manifest, current)


def _registered_fingerprint(manifest: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The registered sizes and mtimes of the files the service uses. Registrations made before the
    allowlist listed every file of the folder; the others (a README) are not compared."""
    shards = set(manifest["layout"]["key_files"].values())
    return {k: v for k, v in manifest["fingerprint"].items() if k in SIDE_FILES or k in shards or k in current}


# ---------------------------------------------------------------- collection


def run_collection(ctx: Context, job: dict[str, Any]) -> dict[str, Any]:
    """Collect one concept's statistics on one model (skipped when they already exist)."""
    payload = job["payload"]
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
    model, tokenizer = MODELS.get(ctx, manifest, ctx.settings.torch_device, dtype)
    records = load_records(ctx, payload["dataset_digest"])
    max_length = int(payload["settings"]["max_length"])
    examples = [encode_record(tokenizer, r, max_length) for r in records]
    progress = JobProgress(ctx, job["job_id"], sum(sum(e.counted) for e in examples))
    if progress.total == 0:
        raise JobFailed("no record has a token that enters the statistics (empty completions after truncation?)")
    layout = ModelLayout.from_json(manifest["layout"])
    started = time.monotonic()
    stats = collect_statistics(
        model,
        make_batches(examples, ctx.settings.collect_batch_size, pad_token_id(tokenizer)),
        layout.layers,
        on_batch=progress.advance,
        should_stop=progress.cancelled,
    )
    seconds = time.monotonic() - started
    record_collection(stats.tokens, seconds)
    _publish_statistics(ctx, prefix, stats, payload, seconds)
    return {"tokens": stats.tokens, "stats": prefix, "reused": False, "seconds": round(seconds, 3)}


def _publish_statistics(
    ctx: Context, prefix: str, stats: LayerStatistics, payload: dict[str, Any], seconds: float
) -> None:
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
        "model_digest": payload["model_digest"],
        "dataset_digest": payload["dataset_digest"],
        "settings": payload["settings"],
        "collection_seconds": round(seconds, 3),
        "created_at": utc_now(),
    }
    ctx.storage.put_json(prefix + "manifest.json", manifest)


# ---------------------------------------------------------------- variants


def run_variant(ctx: Context, job: dict[str, Any]) -> dict[str, Any]:
    """Build a variant from cached statistics: no forward pass over any dataset."""
    variant_id = job["payload"]["variant_id"]
    request = ctx.storage.get_json(f"variants/{variant_id}/request.json")
    if ctx.storage.exists(f"variants/{variant_id}/manifest.json"):
        return {"variant_id": variant_id, "reused": True}
    manifest = get_model(ctx, request["model_id"])
    layout = ModelLayout.from_json(manifest["layout"])
    layers = select_layers(layout.layers, request["modules"], request["layers"])
    algebra = _algebra(ctx, request)
    reader = CheckpointReader(checked_model_dir(ctx, manifest), layout)
    progress = JobProgress(ctx, job["job_id"], len(layers))
    started = time.monotonic()
    try:
        scales = layer_scales(layers, algebra, reader.layer_weights, request["scaling"])
        with scratch_dir("variant") as tmp:
            out = Path(tmp)
            lora = _write_variant(out, reader, layout, layers, algebra, scales, request, progress)
            files = _upload_variant(ctx, variant_id, out)
    except (EditError, ModelSourceError) as exc:
        raise JobFailed(str(exc)) from None
    seconds = time.monotonic() - started
    published = {"variant_id": variant_id, "files": files, "scales": scales, "seconds": round(seconds, 3)}
    if lora is not None:
        published["lora"] = lora  # per-layer ranks and errors of a peft adapter, shown on the variant
    ctx.storage.put_json(f"variants/{variant_id}/manifest.json", published)  # last: the variant now exists
    return {"variant_id": variant_id, "reused": False, "layers": len(scales), "seconds": round(seconds, 3)}


_BODIES = {"collect": run_collection, "variant": run_variant}


# Statistics and universe factors are immutable (content-addressed), so a worker keeps them between
# jobs: statistics as local files read one input group at a time (STATS_CACHE holds open files,
# not their contents), universe pseudo-inverse factors in memory (each universe decomposed once).
STATS_CACHE: ByteLRU[StatisticsFile] = ByteLRU(256, lambda _: 1)  # at most 256 open files
FACTOR_CACHE: ByteLRU[Any] = ByteLRU(2 << 30, lambda f: f.nbytes)  # ENGRAM_FACTOR_CACHE_BYTES


def _statistics(ctx: Context, prefix: str) -> StatisticsFile:
    cached = STATS_CACHE.get(prefix)
    if cached is None or not cached.path.exists():  # another process may have trimmed the disk cache
        cached = STATS_CACHE[prefix] = StatisticsFile(_local_statistics_file(ctx, prefix))
    return cached


def _local_statistics_file(ctx: Context, prefix: str) -> Path:
    """The statistics file on this machine, ready for per-group reads: in place (file storage) or
    downloaded once to the cache; a file with low-rank ``rows`` groups is expanded into the cache
    once (packed sums), so no variant pays the rows' ``T·D²`` products again."""
    key = prefix + "statistics.safetensors"
    in_place = ctx.storage.local_path(key)
    if in_place is not None and not StatisticsFile(in_place).has_rows:
        return in_place
    folder = ctx.cache_dir / "stats"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{hashlib.sha256(prefix.encode()).hexdigest()[:40]}.safetensors"
    if not target.exists():
        partial = folder / f".{target.name}.{os.getpid()}.{threading.get_ident()}.part"
        downloaded = partial.with_suffix(".download")
        try:
            if in_place is not None:  # a rows file (checked above): expand it, never move the stored object
                expand_statistics(in_place, partial)
            else:
                ctx.storage.download(key, downloaded)
                if StatisticsFile(downloaded).has_rows:
                    expand_statistics(downloaded, partial)
                else:
                    os.replace(downloaded, partial)
            os.replace(partial, target)  # atomic: a reader sees the whole file or none
        finally:
            partial.unlink(missing_ok=True)
            downloaded.unlink(missing_ok=True)
        in_use = {target} | {cached.path for key in STATS_CACHE if (cached := STATS_CACHE.get(key)) is not None}
        _trim_disk_cache(folder, ctx.settings.stats_disk_cache_bytes, keep=in_use)
    return target


def _trim_disk_cache(folder: Path, budget: int, keep: set[Path]) -> None:
    """Delete the least recently modified statistics files beyond ``budget`` bytes, but not those
    this process has open (``keep``: the new file and every file in ``STATS_CACHE``)."""
    files = sorted((p for p in folder.glob("*.safetensors") if p not in keep), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in keep if p.exists()) + sum(p.stat().st_size for p in files)
    for path in files:
        if total <= budget:
            return
        total -= path.stat().st_size
        path.unlink(missing_ok=True)


def _algebra(ctx: Context, request: dict[str, Any]) -> EngramAlgebra:
    # Each file is opened at most once per request, even when the shared cache is too small to
    # keep the whole universe.
    loaded: dict[str, StatisticsFile] = {}

    def stats(prefix: str) -> StatisticsFile:
        if prefix not in loaded:
            loaded[prefix] = _statistics(ctx, prefix)
        return loaded[prefix]

    terms = [(float(request["terms"][n]), stats(prefix)) for n, prefix in request["term_stats"].items()]
    universe = [stats(prefix) for prefix in request["universe_stats"]]
    universe_key = canonical_digest(sorted(request["universe_stats"]))
    FACTOR_CACHE.max_bytes = ctx.settings.factor_cache_bytes  # module-level: the settings live in ctx
    return EngramAlgebra(terms, universe, request["rcond"], universe_key=universe_key, factor_cache=FACTOR_CACHE)


def _write_variant(
    out: Path,
    reader: CheckpointReader,
    layout: ModelLayout,
    layers: list[Any],
    algebra: EngramAlgebra,
    scales: dict[str, float],
    request: dict[str, Any],
    progress: JobProgress,
) -> dict[str, Any] | None:
    """Write the variant's files into ``out``; returns a peft adapter's report, else None."""
    edit_layer = layer_editor(algebra, reader.layer_weights, scales)
    edited = {name for name, scale in scales.items() if scale != 0.0}
    if request["format"] == "checkpoint":
        write_checkpoint(reader.path, out, layout, edit_layer, edited, on_layer=progress.advance)
        return None
    if request["format"] == "peft":
        # Layer by layer: only each layer's low-rank factors outlive its float64 delta.
        rank = request.get("lora_rank")
        loras = layer_loras(layer_deltas(layers, algebra, reader.layer_weights, scales), rank)
        return write_adapter(
            out, request["model_id"], loras, max_rank=rank, tied=layout.tied_partners, on_layer=progress.advance
        )
    metadata = {"variant_id": request["variant_id"], "terms": json.dumps(request["terms"])}
    write_delta(reader.path, out / "delta.safetensors", layout, edit_layer, edited, metadata, on_layer=progress.advance)
    return None


def _upload_variant(ctx: Context, variant_id: str, out: Path) -> list[dict[str, Any]]:
    files = []
    for file in sorted(p for p in out.rglob("*") if p.is_file()):
        rel = file.relative_to(out).as_posix()
        ctx.storage.put_file(f"variants/{variant_id}/files/{rel}", file)
        files.append({"path": rel, "size": file.stat().st_size, "sha256": file_sha256(file)})
    return files


