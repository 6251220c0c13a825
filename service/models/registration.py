"""Registering a model: checked in the request, inspected by a ``register`` job.

Registering a checkpoint hashes every file the service uses and builds the model on the ``meta``
device to learn its layers (transformers, about 180 MB that would stay in the process); a remote
one (``s3://``, ``hf://``) is downloaded first: minutes and gigabytes for a real model. The API
process (small, and answering other requests meanwhile) does none of it. The request checks what it
can without reading the checkpoint (the ID, the source's form, for a ``file://`` folder that it lies
in ``ENGRAM_MODEL_ROOTS``, for an ``s3://`` one that ``ENGRAM_MODEL_BUCKETS`` lists its bucket, an
earlier registration of the same ID) and starts a ``register`` job, which a worker runs
(:func:`service.models.inspection.run_registration`). The same registration posted while its job
runs follows that job.
"""

from __future__ import annotations

from dataclasses import dataclass

from api_schemas.provenance import MetadataFields
from service.context import Context
from service.engine.model_checks import check_model_dir
from service.engine.model_files import ModelSourceError
from service.errors import Conflict, InvalidInput
from service.jobs.admission import admit
from service.jobs.records import JobRecord, RegisterPayload
from service.jobs.store import new_job
from service.models.gguf_source import gguf_file_of
from service.models.provenance import registration_request
from service.models.record import ModelRecord
from service.models.registry import files_changed, find_model
from service.models.sources import check_model_bucket, check_remote_source, is_remote, local_model_dir
from service.storage.keys import registration_key

_ACTIVE = ("queued", "running")


@dataclass(frozen=True)
class Registration:
    """A registration request's answer: the model's manifest when registered, else the job registering it.

    Attributes:
        outcome: the registration, or the ``register`` job while it runs (it downloads, hashes
            and inspects the checkpoint).
        created: this request registered the model, or started the job that registers it
            (``False``: it was registered already, or another request's job is registering it).
    """

    outcome: ModelRecord | JobRecord
    created: bool


def request_registration(ctx: Context, model_id: str, source: str, meta: MetadataFields | None = None) -> Registration:
    """The registration when it exists; else start (or follow) the job that registers the model.
    ``meta``: the request's labels and reason, kept when this request starts the job
    (:mod:`service.models.provenance`).

    Raises:
        Conflict: the ID is registered, or being registered, with another source.
        InvalidInput: the source is malformed, or a ``file://`` folder is outside the model roots.
    """
    existing = _registered(ctx, model_id, source)
    if existing is not None:
        return Registration(existing, False)
    check_source(ctx, source)
    with ctx.lock:
        existing = _registered(ctx, model_id, source)
        if existing is not None:
            return Registration(existing, False)
        running = registering_job(ctx, model_id)
        if running is not None:
            running_source = running.payload_of(RegisterPayload).source
            if running_source != source:
                raise Conflict(f"model {model_id} is being registered with source {running_source}")
            return Registration(running, False)  # another request's job: that one answers 201
        admit(ctx)
        job = ctx.jobs.create(new_job("register", RegisterPayload(model_id=model_id, source=source), unit="steps"))
        ctx.storage.put_json(registration_key(model_id), registration_request(model_id, source, job.job_id, meta))
    ctx.dispatch(job)
    return Registration(ctx.jobs.get(job.job_id) or job, True)


def check_source(ctx: Context, source: str) -> None:
    """Refuse (422) what the request can tell is wrong without reading the weights: an unknown
    scheme, a malformed ``s3://``/``hf://`` source, an ``s3://`` bucket ``ENGRAM_MODEL_BUCKETS`` does
    not list (or the store's own), a ``file://`` path that is not a folder inside ``ENGRAM_MODEL_ROOTS``
    (links resolved), or a folder :func:`check_model_dir` refuses (no
    config, remote code, pickle weights, a quantized model, a link leading out). The job checks all
    of it again, then the weights."""
    if is_remote(source):
        check_remote_source(source)
        check_model_bucket(source, ctx.settings)
        return
    if gguf_file_of(source, ctx.settings.model_root_paths) is not None:
        return  # a GGUF file: the register job reads its header and dequantizes it (service.models.gguf_convert)
    path = local_model_dir(source, ctx.settings.model_root_paths, ctx.cache_dir, ctx.settings.s3_endpoint_url)
    try:  # the folder's side files only (config, tokenizer config, file names): a refused one writes nothing
        check_model_dir(path)
    except ModelSourceError as exc:
        raise InvalidInput(str(exc)) from None


def registering_job(ctx: Context, model_id: str) -> JobRecord | None:
    """The ``register`` job of ``model_id`` while it is queued or running, else None."""
    pending = ctx.storage.find_json(registration_key(model_id))
    job = ctx.jobs.get(pending["job_id"]) if pending and pending.get("job_id") else None
    return job if job is not None and job.status in _ACTIVE else None


def _registered(ctx: Context, model_id: str, source: str) -> ModelRecord | None:
    """The registration of ``model_id`` when it has this source (``None`` when its files changed since:
    registered anew); a 409 when it has another."""
    existing = find_model(ctx, model_id)
    if existing is not None and existing.source != source:
        raise Conflict(f"model {model_id} is already registered with source {existing.source}")
    return None if existing is not None and files_changed(existing) else existing
