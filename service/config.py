"""Service settings: one ``Settings`` read from ``ENGRAM_*`` environment variables."""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# S3's rule for bucket names (what AWS, MinIO and SeaweedFS create): a name botocore or the server
# would refuse, or one that is no name at all (``user@host``, ``host:port``), is refused by this rule.
S3_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
S3_BUCKET_RULE = "3 to 63 lower-case letters, digits, dots and hyphens, beginning and ending with a letter or digit"


class Settings(BaseSettings):
    """Everything configurable, validated at start-up so nonsense fails early."""

    model_config = SettingsConfigDict(env_prefix="ENGRAM_", extra="ignore")

    # Where statistics, universes, variants and job records live: file:///abs/dir or
    # s3://bucket/prefix. Default: file:// on ./.engram under the directory the process starts in.
    storage_url: str = Field(default_factory=lambda: "file://" + str(Path(".engram").resolve()))
    # The S3-compatible endpoint (MinIO, SeaweedFS) for s3:// storage, models and datasets; unset: AWS.
    s3_endpoint_url: str | None = None
    # redis://host:port/db of the Celery broker: set, jobs run on workers (distributed mode);
    # unset, they run in a job process beside the API (embedded mode).
    broker_url: str | None = None
    # The directories file:// models may be registered from, ":"-separated; empty: none may be.
    # A server setting: a model outside them is refused (the client cannot widen it).
    model_roots: str = ""
    # Where file:// dataset references may point (besides ENGRAM_MODEL_ROOTS), ":"-separated.
    dataset_roots: str = ""
    # The buckets s3:// dataset references may name, comma-separated. Empty (the default): s3://
    # datasets are refused, as file:// ones are without roots. The service's credentials usually
    # read more than datasets (its own store, other teams' buckets), and a reference makes the
    # service read for whoever posts it, so the readable buckets are listed, never guessed. The
    # store's own bucket (ENGRAM_STORAGE_URL) is never one: listing it stops the service at start-up.
    dataset_buckets: str = Field(default="", description="comma-separated S3 bucket names")
    # The buckets s3:// models may be registered from, comma-separated. Empty (the default): s3://
    # models are refused, as s3:// datasets are without ENGRAM_DATASET_BUCKETS, for the same reason:
    # the service's credentials read more than models, and registering a model makes every key able
    # to download its weights in a variant. Never the store's own bucket (refused at start-up).
    model_buckets: str = Field(default="", description="comma-separated S3 bucket names")
    # Where workers keep local copies (statistics, downloaded models and datasets). Default:
    # ~/.cache/engram-service.
    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "engram-service")
    # API keys, comma-separated `key:scope` entries (scope read, write or admin); unset: no
    # authentication (every caller is one anonymous key).
    api_keys: str | None = None
    # Where jobs run the model: "auto" is CUDA when torch sees a GPU, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"

    # Collection settings. max_length is part of a statistic's identity (it changes Σ);
    # the batch size is not (padding never changes a statistic).
    max_length: int = Field(default=512, ge=8, le=32768)
    collect_batch_size: int = Field(default=8, ge=1, le=1024)
    # Padded tokens per forward pass when evaluate and calibrate score probes (batches are cut by
    # tokens, not probes, so many long probes cost what a few do; a probe longer than this is a
    # batch alone, and no probe is longer than min(the model's context, max_length) tokens). The
    # float32 logits of a batch are this × vocabulary × 4 bytes: 2048 is 256 MiB at a 32k
    # vocabulary, 1 GiB at 128k; 16 probes of 128 tokens, or four of the default 512.
    eval_batch_tokens: int = Field(default=2048, ge=64, le=1 << 20)
    # How Σ is stored. float64 keeps the sums exactly as accumulated; float32 halves the bytes and
    # moves an edit by up to ~1e-4 relative on ill-conditioned layers (see service/engine/stats_io.py).
    stats_dtype: Literal["float64", "float32"] = "float64"
    # The dtype the model runs in during collection: as stored, or e.g. bfloat16 on a GPU (about
    # twice as fast there). Covariances accumulate in float32 products and float64 sums either way.
    collect_dtype: Literal["stored", "float32", "bfloat16", "float16"] = "stored"
    # Where collection puts the model: "none", the whole model on ENGRAM_DEVICE (as before); "auto",
    # accelerate's placement across the node's GPUs, then CPU offload, for models larger than one
    # device. Each layer's accumulators live on its own device; the statistics do not change.
    device_map: Literal["none", "auto"] = "none"
    # Workers keep downloaded statistics files in ENGRAM_CACHE_DIR/stats/ up to this many bytes.
    stats_disk_cache_bytes: int = Field(default=64 << 30, ge=0)
    # Universe pseudo-inverses a worker keeps in memory (float64 [D, D] per input group), in bytes:
    # a variant of an already-decomposed universe skips every eigendecomposition. One universe of
    # the bench's 100M Llama takes 0.6 GB; of a Llama-3.2-1B about 10 GB.
    factor_cache_bytes: int = Field(default=2 << 30, ge=0)
    # Stored universes (pseudo-inverse factors and engrams) together, in bytes; 0: no limit. A new
    # universe is projected before it is built and refused (409) when it does not fit, once unused
    # universes are evicted (service/universes/retention.py). One universe of the bench's 100M
    # Llama with 4 concepts takes 1.6 GB; of a Llama-3.2-1B with 3 concepts about 25 GB.
    universe_bytes_budget: int = Field(default=256 << 30, ge=0)
    # A universe used within this many seconds (requested, a variant requested from it, built) is
    # kept, as is any model's current universe or one a running job builds or reads; any other
    # may be evicted: to make room within the budget, and by the janitor.
    universe_retention_s: float = Field(default=7 * 24 * 3600, ge=0)
    # Ready variants' files together, in bytes; 0 (the default): no bound. Applied after each build
    # and by the janitor: the least recently downloaded variants are deleted first, never one a job
    # builds or reads or one downloaded within the last 10 minutes (service/variants/retention.py).
    variant_bytes_budget: int = Field(default=0, ge=0)
    # A variant not downloaded (or created) within this many seconds is deleted by the janitor; 0
    # (the default): kept until deleted. The same request builds it again under the same ID.
    variant_retention_s: float = Field(default=0, ge=0)
    # Audit entries older than this many days are deleted by the janitor (service/storage/audit_retention.py);
    # 0 (the default): the audit log is kept for good. Days, as audit policies are stated (90, 365).
    audit_retention_days: float = Field(default=0, ge=0)
    # Ed25519 private key that signs variant receipts (GET /variants/{id}/receipt): a path to a PEM
    # file, or the PEM itself. Unset: receipts are served unsigned and say so.
    receipt_signing_key: str | None = None
    # The fraction of the (effective) universe budget that the universes one API key used within the
    # retention window may hold (a universe several keys use counts in full for each of them); a key
    # past it gets a 409 naming this setting, so one key cannot fill the budget for everyone.
    # Unset: 0.5 with ENGRAM_API_KEYS (two keys can each still build), 1.0 without (every caller is
    # the same key: a share would only shrink the budget).
    universe_key_share: float | None = Field(default=None, gt=0, le=1)
    # file:// storage: the universe budget is capped at this fraction of the store's volume (its
    # used + free bytes), as the budget's default (256 GiB) exceeds many disks; the store also holds
    # statistics, uploads and variant files, so half by default. S3 has no volume to check.
    universe_volume_fraction: float = Field(default=0.5, gt=0, le=1)
    # How often each API process's janitor applies the retention rule (0: at start-up only).
    janitor_interval_s: float = Field(default=3600, ge=0)

    # Distributed mode. The broker's visibility timeout must exceed the hard limit, or Redis would
    # hand a still-running task to a second worker.
    task_hard_limit_s: int = Field(default=4 * 3600, ge=5)
    # Tries of a job after a transient error (storage or broker away), with backoff, before it fails.
    task_max_retries: int = Field(default=5, ge=0, le=100)
    # How often one API process (elected by a Redis lock) re-queues jobs whose worker went silent or
    # whose message was lost.
    reconcile_interval_s: float = Field(default=15.0, gt=0)
    heartbeat_ttl_s: int = Field(default=60, ge=2, description="a running job whose worker is silent this long is re-queued")
    # A universe build asks up to this many idle workers to decompose its input groups (and write its
    # members' engrams) alongside it, each part claimed through a Redis lease; 0: the job builds alone.
    universe_helpers: int = Field(default=8, ge=0, le=256)
    # Loaded models a job process or worker keeps in memory between jobs (each costs its weights' RAM).
    model_cache_size: int = Field(default=1, ge=1, le=16)
    worker_metrics_port: int | None = Field(default=None, ge=1, le=65535, description="a worker's /metrics port")
    # How log lines on stderr are written: "json" (one object a line, for containers and log
    # shippers), "text" (`time level logger: message`, for a person at a terminal) or "auto": text
    # when stderr is a terminal, JSON otherwise.
    log_format: Literal["auto", "json", "text"] = "auto"
    # s3:// storage: GET /variants/{id}/files/{path} redirects to a presigned S3 URL instead of
    # streaming the file through the API.
    presign_downloads: bool = False
    # How long a presigned download URL stays valid.
    presign_expiry_s: int = Field(default=3600, ge=60, le=7 * 24 * 3600)

    # Chat templates are programs from the model folder: collection renders them in a child process
    # (service/engine/template_render.py) bounded by these. A real template renders a conversation in
    # milliseconds, in a few MB: 10 s, 1 GiB and 32 Mi characters (a whole JSON body's worth of
    # text) refuse only templates that loop or build huge strings; the record fails naming the setting.
    template_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    template_memory_bytes: int = Field(default=1 << 30, ge=256 << 20)
    template_max_chars: int = Field(default=32 << 20, ge=1024)
    # A job that has not stopped this many seconds after DELETE /jobs/{id} (stuck in native code: a
    # tokenizer, a model load, a blocking read) is stopped by ending its process: embedded mode kills
    # the job process and starts another (the other jobs it ran are queued again: jobs are
    # idempotent); a Celery worker ends its pool process and the redelivered message finds the job
    # cancelled. Every phase checks cancellation within a second, so 10 s only catches what cannot.
    cancel_grace_s: float = Field(default=10.0, gt=0, le=3600)
    # The memory one job process may hold, in bytes: embedded mode's job process, each Celery pool
    # process (service/execution/memory_budget.py sets its RLIMIT_DATA: heap and private mappings,
    # what tensors take; not the address space torch and CUDA reserve unused). Past it an allocation
    # fails and its job fails naming this setting; the process runs the next job. Unset: 80% of the
    # machine's memory (the container's limit where lower), the rest left to the API, the OS and the
    # page cache: a fixed default would be too small for an 8B model (~16 GB in bfloat16) on one
    # machine and no bound on another. 0: no limit. Anything else at least 512 MiB: an idle job
    # process holds ~400 MB of data with every job body (torch, transformers) imported.
    job_memory_bytes: int | None = Field(default=None, ge=0)

    # A request's line and headers together, in bytes: past it the server answers 431 and closes the
    # connection (service/api/header_limit.py), before the head is buffered whole (uvicorn's httptools
    # parser has no limit of its own). 64 KiB is four times the 16 KiB h11 and Node.js allow and twice
    # nginx's default header buffers (4 × 8 KiB), so no client that passes a common proxy is refused,
    # while 1,000 open connections hold at most 64 MB of heads.
    max_header_bytes: int = Field(default=64 << 10, ge=4096, le=16 << 20)
    # Request limits: a JSON body and a multipart upload.
    max_json_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1024)
    # The values (array elements and object members) a JSON body may hold, counted from its bytes
    # before it is decoded (service/api/json_cost.py): the byte limit bounds what a body is, this
    # what it becomes. Decoded and validated, a value costs the API ~150 to 270 bytes (an empty
    # record; a text record, spooled): 28 MiB of "{}," took it to 1.7 GiB, and 500,000 text records
    # (1 million values, 12.8 MiB) grow its peak 265 MiB. Half a million values (~130 MiB) hold an
    # evaluation's every set at the schema's 10,000 prompt/completion probes (3 values each), or
    # 250,000 text records; a larger dataset goes as an upload or a reference, read a record at a time.
    max_json_values: int = Field(default=500_000, ge=1024)
    # Records of one concept, whatever brings them (a JSON body, an upload, a reference).
    max_records: int = Field(default=1_000_000, ge=1)
    # Texts a self-sampled reference concept (POST /concepts with "samples") may ask the model to
    # draw. Each is a generate() of max_new_tokens tokens in the collection job, so unlike posted
    # records a small request buys a long job (count × max_new_tokens decoding steps): 5,000 is
    # 20× the 240 texts issue 36's reference used on the real model. Past it: a 422 naming it.
    max_samples: int = Field(default=5_000, ge=1)
    # One record's stored bytes, whatever brings it (a JSON body, an upload, a reference): past it a
    # 413 names this setting. Collection cuts every text to a character budget before tokenizing
    # (service/engine/record_budget.py), so a long record costs no tokenizer memory; this bound is
    # on what reading one record costs (a JSON line parsed whole, in the API and in the job).
    # 16 MiB: 128× the ~128 KB of text the largest max_length (32768 tokens) reads.
    max_record_bytes: int = Field(default=16 << 20, ge=1024)
    # One image record's pixels (width × height of its first frame): Pillow refuses past it before
    # decoding, so a decompression bomb (a small PNG of a huge blank canvas) is a 413 naming the
    # record, never a worker's memory. 40 megapixels: well past a 4K photo, and a classifier reads
    # 224² or so. Pillow itself refuses any image over about 179 megapixels whatever this says.
    # It bounds the model's resize too: a job refuses, before decoding, an image its image processor
    # would hold more pixels of on the way (a shortest-edge resize keeps the aspect ratio:
    # service/engine/image_resize.py), naming the record and this setting.
    max_image_pixels: int = Field(default=40_000_000, ge=1024, le=178_956_970)
    # A dataset by reference: the source object's bytes and its stored records' bytes (each).
    max_dataset_bytes: int = Field(default=4 << 30, ge=1024)
    # hf:// dataset files a worker keeps in ENGRAM_CACHE_DIR/hf-datasets, in bytes: after each fetch
    # the least recently used are deleted down to this (the file the job reads always stays, so 0
    # keeps only that one). Default: four datasets of the largest size ENGRAM_MAX_DATASET_BYTES allows.
    hf_datasets_cache_bytes: int = Field(default=16 << 30, ge=0)
    # Requests waiting with ?wait= hold no thread, but each polls the job: beyond this many at once,
    # one more is a 429 with Retry-After.
    max_waiters: int = Field(default=128, ge=0, le=100_000)
    # Admission control: jobs not finished yet (queued or running), in total and per API key (the
    # anonymous caller counts as one key when auth is off). Past either, a request that would start
    # a job is a 429 with Retry-After and submits nothing; a request answered by an existing job or
    # result is never refused. A job runs for seconds to minutes on one worker lane, so 64 queued
    # per key is hours of work, enough for a sweep, and 512 in total keeps eight such clients busy;
    # beyond that a client waits for its jobs instead of growing a queue no worker will reach soon.
    max_queued_jobs: int = Field(default=512, ge=1, le=1_000_000)
    max_queued_jobs_per_key: int = Field(default=64, ge=1, le=1_000_000)

    # Completion callbacks: only these hosts (``host`` or ``host:port``) may be called back, and
    # every call is signed with the secret (Standard Webhooks: webhook-id/-timestamp/-signature).
    callback_hosts: str = Field(default="", description="comma-separated host or host:port entries")
    # The HMAC key every callback is signed with (required when ENGRAM_CALLBACK_HOSTS is set).
    callback_secret: SecretStr | None = None
    # Tries of one callback before it is dead-lettered.
    callback_max_attempts: int = Field(default=10, ge=1, le=100)
    callback_backoff_s: float = Field(default=1.0, gt=0, le=3600, description="first retry delay; doubles up to 10 min")
    # How long one delivery waits for the receiver's answer.
    callback_timeout_s: float = Field(default=10.0, gt=0, le=120)
    # What a delivery reads of a receiver's answer, in bytes (ENGRAM_CALLBACK_TIMEOUT_S bounds the whole
    # delivery, connect to last byte read, not each read). The status alone decides the outcome; the
    # body is read only so that a short answer's connection is kept for the next delivery. 4 KiB holds
    # any acknowledgement or short error page; a longer body is dropped with its connection, so an
    # endless one costs one read (64 KiB), not the process's memory.
    callback_max_response_bytes: int = Field(default=4096, ge=0, le=1 << 20)
    callback_poll_s: float = Field(default=1.0, gt=0, le=300, description="how often pending callbacks are looked for")
    # Deliveries at once. A receiver that never answers holds one for ENGRAM_CALLBACK_TIMEOUT_S and
    # is then on backoff; 8 lets seven such receivers at once leave a lane for everyone else's
    # callbacks, at the cost of 8 idle threads, and stays far below any receiver's connection limit.
    callback_concurrency: int = Field(default=8, ge=1, le=64)

    # MLflow tracking (docs/how-to/callbacks.md): set to a tracking server's URI (http://mlflow:5000),
    # each variant built and each evaluation is logged as a run there by the worker that ran it, with
    # its options, metrics, receipt and model card; unset (the default): nothing is logged. Needs the
    # optional extra engram-service[mlflow]. A run that cannot be logged never fails its job: the job's
    # result says so in `tracking`, and the worker logs a WARNING.
    mlflow_tracking_uri: str | None = None
    # The MLflow experiment the runs go to (created on first use).
    mlflow_experiment: str = Field(default="engram-service", min_length=1, max_length=500)
    # How long one request to the tracking server may take before the run is given up (two retries).
    mlflow_timeout_s: float = Field(default=10.0, gt=0, le=300)
    # The URL clients reach this API at (https://engram.example.com): tracked runs link to the
    # variant, its receipt, model card and jobs there. Unset: the links are paths (/variants/<id>).
    public_url: str | None = None

    @field_validator("storage_url")
    @classmethod
    def _storage_scheme(cls, value: str) -> str:
        scheme = urlparse(value).scheme
        if scheme not in {"file", "s3"}:
            raise ValueError(f"ENGRAM_STORAGE_URL must be file:///abs/dir or s3://bucket/prefix, got {value!r}")
        if scheme == "file" and not urlparse(value).path.startswith("/"):
            raise ValueError(f"ENGRAM_STORAGE_URL needs an absolute path, got {value!r}")
        return value

    @field_validator("device_map", mode="before")
    @classmethod
    def _device_map_unset(cls, value: object) -> object:
        # An empty ENGRAM_DEVICE_MAP= (docker-compose's ${ENGRAM_DEVICE_MAP:-}) means unset.
        if isinstance(value, str):
            value = value.strip().lower()
        return "none" if value in ("", None) else value

    @field_validator("job_memory_bytes")
    @classmethod
    def _job_memory_is_enough(cls, value: int | None) -> int | None:
        if value is not None and 0 < value < 512 << 20:
            raise ValueError(
                f"ENGRAM_JOB_MEMORY_BYTES={value} is below 512 MiB, about what a job process holds idle "
                "(~400 MB with torch and transformers imported); set at least 536870912, or 0 for no limit"
            )
        return value

    @field_validator("broker_url")
    @classmethod
    def _broker_scheme(cls, value: str | None) -> str | None:
        if value and urlparse(value).scheme not in {"redis", "rediss"}:
            raise ValueError(f"ENGRAM_BROKER_URL must be redis://host:port/db, got {value!r}")
        return value or None

    @field_validator("mlflow_tracking_uri", "public_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # An empty ENGRAM_MLFLOW_TRACKING_URI= (docker-compose's ${...:-}) means unset.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("public_url")
    @classmethod
    def _public_url_is_http(cls, value: str | None) -> str | None:
        if value is not None and urlparse(value).scheme not in {"http", "https"}:
            raise ValueError(f"ENGRAM_PUBLIC_URL must be an http:// or https:// URL, got {value!r}")
        return value.rstrip("/") if value is not None else None

    @model_validator(mode="after")
    def _mlflow_is_installed(self) -> Settings:
        if self.mlflow_tracking_uri and importlib.util.find_spec("mlflow") is None:
            raise ValueError(
                "ENGRAM_MLFLOW_TRACKING_URI is set but the MLflow client is not installed: "
                "pip install 'engram-service[mlflow]', or unset ENGRAM_MLFLOW_TRACKING_URI"
            )
        return self

    @model_validator(mode="after")
    def _dataset_buckets_are_buckets(self) -> Settings:
        for name in self.dataset_bucket_names:
            if not S3_BUCKET_NAME.fullmatch(name):
                raise ValueError(f"ENGRAM_DATASET_BUCKETS: {name!r} is not a bucket name ({S3_BUCKET_RULE})")
        if self.storage_bucket in self.dataset_bucket_names:
            raise ValueError(
                f"ENGRAM_DATASET_BUCKETS lists {self.storage_bucket!r}, the bucket of ENGRAM_STORAGE_URL: "
                "the service's own store is never a dataset source (anyone could read its statistics "
                "and variants through a reference); remove it"
            )
        return self

    @model_validator(mode="after")
    def _model_buckets_are_buckets(self) -> Settings:
        for name in self.model_bucket_names:
            if not S3_BUCKET_NAME.fullmatch(name):
                raise ValueError(f"ENGRAM_MODEL_BUCKETS: {name!r} is not a bucket name ({S3_BUCKET_RULE})")
        if self.storage_bucket in self.model_bucket_names:
            raise ValueError(
                f"ENGRAM_MODEL_BUCKETS lists {self.storage_bucket!r}, the bucket of ENGRAM_STORAGE_URL: "
                "the service's own store is never a model source (anyone could register its statistics "
                "and variants as a model and download them); keep models in another bucket"
            )
        return self

    @model_validator(mode="after")
    def _callbacks_are_signed(self) -> Settings:
        if self.callback_allowed_hosts and not (self.callback_secret and self.callback_secret.get_secret_value()):
            raise ValueError("ENGRAM_CALLBACK_HOSTS is set: set ENGRAM_CALLBACK_SECRET too (callbacks are always signed)")
        return self

    @property
    def dataset_bucket_names(self) -> frozenset[str]:
        """The buckets ``s3://`` dataset references may name (ENGRAM_DATASET_BUCKETS)."""
        return frozenset(b.strip() for b in self.dataset_buckets.split(",") if b.strip())

    @property
    def model_bucket_names(self) -> frozenset[str]:
        """The buckets ``s3://`` models may be registered from (ENGRAM_MODEL_BUCKETS)."""
        return frozenset(b.strip() for b in self.model_buckets.split(",") if b.strip())

    @property
    def storage_bucket(self) -> str | None:
        """The bucket of an ``s3://`` ENGRAM_STORAGE_URL; ``None`` for ``file://`` storage."""
        parsed = urlparse(self.storage_url)
        return parsed.netloc if parsed.scheme == "s3" else None

    @property
    def callback_allowed_hosts(self) -> frozenset[str]:
        """Lower-cased ``host`` / ``host:port`` entries that callbacks may reach."""
        return frozenset(h.strip().lower() for h in self.callback_hosts.split(",") if h.strip())

    @property
    def task_soft_limit_s(self) -> int:
        """The soft limit (0.9 × hard) lets a task clean up before it is killed."""
        return max(1, int(self.task_hard_limit_s * 0.9))

    @property
    def visibility_timeout_s(self) -> int:
        """Above the hard limit, so an unacknowledged task is redelivered only once it is dead."""
        return self.task_hard_limit_s + max(5, self.task_hard_limit_s // 10)

    @property
    def model_root_paths(self) -> list[Path]:
        """Resolved directories from which ``file://`` models may be registered."""
        return [Path(p).resolve() for p in self.model_roots.split(":") if p.strip()]

    @property
    def dataset_root_paths(self) -> list[Path]:
        """Resolved directories ``file://`` dataset references may point into: ENGRAM_DATASET_ROOTS
        and ENGRAM_MODEL_ROOTS."""
        roots = [Path(p).resolve() for p in self.dataset_roots.split(":") if p.strip()]
        return [*roots, *(r for r in self.model_root_paths if r not in roots)]

    @property
    def storage_path(self) -> Path:
        """The local storage directory (``file://`` storage only)."""
        return Path(urlparse(self.storage_url).path)

    @property
    def key_share(self) -> float:
        """ENGRAM_UNIVERSE_KEY_SHARE, or its default: 0.5 with API keys, 1.0 without (one caller)."""
        if self.universe_key_share is not None:
            return self.universe_key_share
        return 0.5 if self.api_keys is not None else 1.0

    @property
    def embedded(self) -> bool:
        """True when jobs run in the API process (no broker configured)."""
        return self.broker_url is None

    @property
    def torch_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@lru_cache
def get_settings() -> Settings:
    return Settings()
