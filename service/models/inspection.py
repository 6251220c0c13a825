"""The ``register`` job: download a checkpoint, inspect it and write its registration.

Inspecting builds the model on the ``meta`` device (torch and transformers) and hashes every file the
service uses, so it lives apart from the request side (:mod:`service.models.registration`) and the
registration reads (:mod:`service.models.registry`), which the API imports: only a process that runs
the job imports this module (``service.execution.kinds`` names its body by import path).
"""

from __future__ import annotations

from pathlib import Path

from service.context import Context
from service.engine.checkpoint import check_tokenizer, combined_digest, file_digests, inspect_model_dir
from service.engine.image_models import ModelKind
from service.engine.images import ImageProcessorError, load_image_processor
from service.engine.layout import ModelLayout
from service.engine.model_checks import check_model_dir
from service.engine.model_file_descriptors import FileIdentity, open_model_files
from service.engine.model_files import ModelSourceError
from service.errors import Conflict, InvalidInput
from service.jobs.records import JobRecord, RegisterPayload
from service.jobs.results import RegisterResult
from service.jobs.store import utc_now
from service.models.gguf_convert import gguf_checkpoint
from service.models.gguf_source import GgufOrigin, gguf_file_in, gguf_file_of
from service.models.loaded import write_copy_record
from service.models.record import ModelRecord, folder_kind
from service.models.registry import files_changed, find_model
from service.models.sources import check_model_bucket, is_remote, local_model_dir
from service.storage.keys import model_key


def run_registration(ctx: Context, job: JobRecord) -> RegisterResult:
    """The ``register`` job body: download and inspect the checkpoint, then write the registration
    (the manifest last: a failed download registers nothing)."""
    payload = job.payload_of(RegisterPayload)
    ctx.jobs.set_progress(job.job_id, 0, 1)
    manifest, created = register_model(ctx, payload.model_id, payload.source)
    ctx.jobs.set_progress(job.job_id, 1, 1)
    return RegisterResult(model_id=manifest.model_id, digest=manifest.digest, created=created)


def register_model(ctx: Context, model_id: str, source: str) -> tuple[ModelRecord, bool]:
    """Register a checkpoint; returns (manifest, created). Same registration twice is a no-op, unless
    the folder's files changed since (:func:`files_changed`): it is then registered anew."""
    existing = find_model(ctx, model_id)
    if existing is not None:
        if existing.source != source:
            raise Conflict(f"model {model_id} is already registered with source {existing.source}")
        if not files_changed(existing):
            return existing, False
    check_model_bucket(source, ctx.settings)  # again in the job: the worker's settings are the ones that read
    path, gguf = _checkpoint_folder(ctx, source)
    layout, sums, identity = _inspect(ctx, path, private_copy=is_remote(source) or gguf is not None)
    if not layout.layers:
        raise InvalidInput("the model has no editable Linear, Conv1D, Conv2d or Conv1d layers in its safetensors weights")
    manifest = ModelRecord(
        model_id=model_id,
        source=source,
        path=str(path),
        digest=combined_digest(sums),
        file_sha256=sums,  # names the file whose content changed, where a job checks it by content
        identity={name: value.to_json() for name, value in identity.items()},
        # sizes and mtimes, as registrations made before identities were: what an older worker reads
        fingerprint={name: value.to_json()[:2] for name, value in identity.items()},
        architecture=layout.architecture,
        kind=_kind(path),
        num_parameters=layout.num_parameters,
        layout=layout,
        registered_at=utc_now(),
        gguf=gguf,
    )
    with ctx.lock:
        again = find_model(ctx, model_id)
        if again is not None and again != existing:  # another registration landed meanwhile: answer it
            return register_model(ctx, model_id, source)
        ctx.storage.put_json(model_key(model_id), manifest.to_json())
    return manifest, True


def _checkpoint_folder(ctx: Context, source: str) -> tuple[Path, GgufOrigin | None]:
    """The checkpoint folder of ``source`` on this machine, and the GGUF file it was dequantized from
    when the source is one (:mod:`service.models.gguf_source`; a remote one is downloaded first)."""
    settings = ctx.settings
    if is_remote(source):
        fetched = local_model_dir(source, [], ctx.cache_dir, settings.s3_endpoint_url)
        gguf_file = gguf_file_in(fetched, inside=ctx.cache_dir)
    else:
        gguf_file = gguf_file_of(source, settings.model_root_paths)
    if gguf_file is not None:
        folder, origin = gguf_checkpoint(ctx.cache_dir, gguf_file)
        return folder.resolve(), origin
    return fetched if is_remote(source) else local_model_dir(source, settings.model_root_paths, ctx.cache_dir), None


def _kind(path: Path) -> ModelKind:
    """Whether the (validated) folder holds an image model; an image model's processor is loaded
    once now, as every collection will (a folder without a usable one is a 422 naming the reason)."""
    try:
        kind = folder_kind(path)
    except ModelSourceError as exc:
        raise InvalidInput(str(exc)) from None
    if kind == "image":
        try:
            load_image_processor(path)
        except ImageProcessorError as exc:
            raise InvalidInput(str(exc)) from None
    return kind


def _inspect(ctx: Context, path: Path, private_copy: bool) -> tuple[ModelLayout, dict[str, str], dict[str, FileIdentity]]:
    """The folder's layout, its files' digests and identities, every file opened once and read through
    its descriptor: the identity recorded is that of the bytes hashed and inspected. ``private_copy``:
    the folder is this machine's own (a download, a dequantized GGUF), recorded as checked here.

    Raises:
        InvalidInput: the folder breaks a rule (a link leading out of it, a shard name that is not a
            plain file name in it, a tensor in two shards...: checked before any weight is read), or
            a file changed while it was read.
    """
    try:
        check_model_dir(path)  # by name first, as the request did: the first problem named as users expect
        with open_model_files(path) as files:
            layout = inspect_model_dir(files)
            check_tokenizer(files)  # one no job could load is refused now, not at every collection
            sums = file_digests(files)
            files.check_unchanged()  # nothing rewritten in place while it was read
            if private_copy:  # this machine's copy is verified: its jobs need not hash it again
                write_copy_record(ctx, files, combined_digest(sums))
            return layout, sums, files.identity()
    except ModelSourceError as exc:
        raise InvalidInput(str(exc)) from None
