"""A model on this machine: its checked files, and the models a worker keeps loaded between jobs.

A job reads a model only through :func:`checked_model_files`: every file the service uses is opened
once and checked through its descriptor (no link in its path, a regular file, the identity
recorded at registration), then read only through that descriptor. A worker (or the embedded job
process) reuses its last loaded models (:func:`loaded_model`, kept in its Context), after the same check.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from service.context import Context
from service.engine.checkpoint import combined_digest, directory_digest, file_digests, load_model, load_tokenizer
from service.engine.model_file_descriptors import FileIdentity, ModelFiles, ModelFilesChanged, open_model_files
from service.engine.model_files import ModelSourceError, check_links
from service.errors import JobFailed
from service.models.gguf_convert import registered_gguf_folder
from service.models.gguf_source import GgufOrigin, check_gguf_unchanged, gguf_file_in
from service.models.record import ModelRecord
from service.models.registry import find_model
from service.models.sources import check_model_bucket, local_model_dir
from service.storage.keys import model_key

REREGISTER = "re-register the model"


def checked_model_files(ctx: Context, manifest: ModelRecord) -> ModelFiles:
    """The files of a registered model on this machine, opened and checked (:mod:`service.engine.model_files`).

    A ``file://`` model is read in place, a remote one (``s3://``, ``hf://``) from this machine's
    private copy. Either way every used file is opened once, through no link leading out, and its
    identity compared (:func:`_check_files`): no job hashes a checkpoint whose identity is known.

    Raises:
        JobFailed: a file is not the registered one, or breaks a rule of the model folder; the
            message names the file and says to re-register the model.
    """
    model_id = manifest.model_id
    try:
        if manifest.gguf is not None:
            path, registered = _gguf_folder(ctx, manifest, manifest.gguf)
        elif manifest.is_local:
            path = Path(manifest.path)
            if not path.is_dir():
                raise ModelSourceError(f"the model folder {path} is gone")
            if path.resolve() != path:  # registered resolved: the folder, or a folder above it, became a link
                raise ModelSourceError("the model folder was replaced by a symbolic link")
            registered = manifest.registered_identity()
        else:
            check_model_bucket(manifest.source, ctx.settings)  # a bucket delisted since registration is read no more
            path = local_model_dir(manifest.source, [], ctx.cache_dir, ctx.settings.s3_endpoint_url)
            registered = None  # each machine downloads its own copy: other inodes and times
        check_links(path)  # a link leading out is refused even where no used file is one (registration did)
        files = open_model_files(path)
        try:
            _check_files(ctx, manifest, files, registered)
        except BaseException:
            files.close()
            raise
        return files
    except ModelSourceError as exc:
        raise JobFailed(f"the files of model {model_id} changed since registration: {exc}; {REREGISTER}") from None


def _gguf_folder(ctx: Context, manifest: ModelRecord, origin: GgufOrigin) -> tuple[Path, None]:
    """The dequantized folder of a GGUF registration on this machine; its files are checked as a
    remote model's private copy is (``None``: by this machine's copy record, else by content once:
    :func:`_check_files`), since the folder is the service's own, rebuilt where it is missing.

    The machine that registered the model reads the folder it built (its copy record written then);
    any other (a worker with its own ``ENGRAM_CACHE_DIR``), or one whose folder was removed,
    dequantizes the same file once into its cache (a ``file://`` file where the model roots are
    shared, a remote one downloaded again) and checks the result against the registration.
    """
    if manifest.is_local:
        check_gguf_unchanged(origin)  # the file the folder was dequantized from, by its identity
    else:
        check_model_bucket(manifest.source, ctx.settings)  # a bucket delisted since registration is read no more
    folder = Path(manifest.path)
    if folder.is_dir() and folder.is_relative_to(ctx.cache_dir.resolve()):
        return folder, None
    if manifest.is_local:
        file = Path(origin.file)
    else:
        fetched = local_model_dir(manifest.source, [], ctx.cache_dir, ctx.settings.s3_endpoint_url)
        file = gguf_file_in(fetched, inside=ctx.cache_dir) or fetched
    return registered_gguf_folder(ctx.cache_dir, file, origin), None


def check_model_unchanged(ctx: Context, manifest: ModelRecord) -> None:
    """Check a model's files again, before a job publishes what it computed with them: a model
    loaded on the CPU maps its shards, so a shard rewritten in place while the job ran changed the
    weights it used (and its identity: a new ctime).

    Raises:
        JobFailed: as :func:`checked_model_files`.
    """
    checked_model_files(ctx, manifest).close()


def _check_files(ctx: Context, manifest: ModelRecord, files: ModelFiles, registered: dict[str, FileIdentity] | None) -> None:
    """Check opened model files by identity, never by hashing them again where it is known.

    - A ``file://`` registration's files must have the identity recorded at registration: any
      difference fails the job (posting the registration again registers the files as they are).
    - A remote model's private copy (or the folder of a registration made before identities were
      recorded) must have the identity it had when this machine last checked its content
      (:func:`copy_record`). Where there is none (a copy new to this machine, an older
      registration), or the copy differs from it (the cache is the service's own: a change is
      damage, not a new version), the content decides, once: each file is hashed through its
      descriptor and compared with the registration, and the identity is remembered.

    Raises:
        ModelFilesChanged: naming the first file that is not the registered one.
    """
    if registered is not None:
        files.check(registered)
        return
    mismatch: ModelFilesChanged | None = None
    known = _machine_identity(ctx, manifest, files.folder)
    if known is not None:
        try:
            files.check(known)
            return
        except ModelFilesChanged as exc:
            mismatch = exc
    _check_content(manifest, files, mismatch)
    write_copy_record(ctx, files, manifest.digest)
    if manifest.is_local:
        _record_identity(ctx, manifest, files)


def _check_content(manifest: ModelRecord, files: ModelFiles, mismatch: ModelFilesChanged | None) -> None:
    """Raise unless ``files`` hold the registered content, naming the first file that does not
    (registrations made before per-file digests were recorded: by the folder's digest, including
    the one of registrations made before the allowlist, which hashed every in-folder file)."""
    sums = file_digests(files)
    recorded = manifest.file_sha256
    why = f" ({mismatch})" if mismatch is not None else ""
    if isinstance(recorded, dict):
        for name in sorted(set(recorded) | set(sums)):
            if recorded.get(name) != sums.get(name):
                state = "is missing" if name not in sums else "was added" if name not in recorded else "has other content"
                raise ModelFilesChanged(f"{name} {state} since registration{why}")
    elif combined_digest(sums) != manifest.digest:
        if directory_digest(files.folder, every_file=True) != manifest.digest:
            raise ModelFilesChanged(f"the files' content is not the registered content (their digest differs){why}")
    files.check_unchanged()  # nothing rewritten in place while it was hashed


def _record_identity(ctx: Context, manifest: ModelRecord, files: ModelFiles) -> None:
    """Give a registration made before identities were recorded the identity of its files, their
    content just checked: from then on it is checked as any other.

    Lazily, not by refusal: such a model cannot be registered again under its ID (posting the
    same registration again returns it: nothing recorded says its files changed), so refusing
    would end it for good; one hash per model is the price.
    """
    identity = {name: value.to_json() for name, value in files.identity().items()}
    with ctx.lock:
        current = find_model(ctx, manifest.model_id)
        if current is not None and current.digest == manifest.digest and current.identity is None:
            ctx.storage.put_json(model_key(manifest.model_id), current.model_copy(update={"identity": identity}).to_json())


def _machine_identity(ctx: Context, manifest: ModelRecord, folder: Path) -> dict[str, FileIdentity] | None:
    """The identity ``folder``'s files had when this machine last found them holding the registered
    content (:func:`write_copy_record`), if it did."""
    saved = _read_record(copy_record(ctx, folder))
    if saved is None or saved.digest != manifest.digest:
        return None
    identity = {name: FileIdentity.from_json(value) for name, value in saved.identity.items()}
    return {name: value for name, value in identity.items() if value is not None} if all(identity.values()) else None


def copy_record(ctx: Context, folder: Path) -> Path:
    """Where this machine keeps the identity of a model folder whose content it checked (a remote
    model's private copy, or an older registration's folder): in ``ENGRAM_CACHE_DIR``, which only
    the service writes."""
    return ctx.cache_dir / "verified-models" / f"{hashlib.sha256(str(folder).encode()).hexdigest()[:40]}.json"


def write_copy_record(ctx: Context, files: ModelFiles, digest: str) -> None:
    """Record that ``files`` hold ``digest`` on this machine, with their identity, atomically."""
    record = copy_record(ctx, files.folder)
    record.parent.mkdir(parents=True, exist_ok=True)
    identity = {name: value.to_json() for name, value in files.identity().items()}
    partial = record.with_name(f".{record.name}.{os.getpid()}.{threading.get_ident()}")
    written = CopyRecord(folder=str(files.folder), digest=digest, identity=identity)
    partial.write_text(json.dumps(written.model_dump()))
    os.replace(partial, record)


class CopyRecord(BaseModel):
    """This machine's record of a model folder whose content it checked (:func:`write_copy_record`).

    Attributes:
        identity: each file's identity as :meth:`FileIdentity.to_json` writes it (read back by
            :meth:`FileIdentity.from_json`, which refuses anything else).
    """

    model_config = ConfigDict(frozen=True)

    folder: str | None = None
    digest: str
    identity: dict[str, list[int]]


def _read_record(record: Path) -> CopyRecord | None:
    """The record; None when there is none, or it is not one (the folder is then checked by content)."""
    try:
        return CopyRecord.model_validate_json(record.read_bytes())
    except (OSError, ValidationError):
        return None


def loaded_model(
    ctx: Context, manifest: ModelRecord, device: str, dtype: str | None = None, device_map: str | None = None
) -> tuple[Any, Any]:
    """The model (in ``dtype``, default: as stored; on ``device``, or placed by accelerate's
    ``device_map``) and its tokenizer (``None`` for an image model), loaded on first use and kept in
    the context's ``caches.models`` (:class:`service.context.ProcessCaches`): a worker reuses it.

    Raises:
        JobFailed: as :func:`checked_model_files`.
    """
    placement = f"map:{device_map}" if device_map else device
    key = f"{manifest.digest}@{placement}/{dtype or 'stored'}"
    # Checked at every job, loaded or not: a job on changed files fails, as one loading them would.
    with checked_model_files(ctx, manifest) as files:

        def load() -> tuple[Any, Any]:
            torch_dtype = getattr(torch, dtype) if dtype else None
            model = load_model(files, device=device, dtype=torch_dtype, device_map=device_map)
            return model, None if manifest.kind == "image" else load_tokenizer(files)  # an image model has none

        loaded: tuple[Any, Any] = ctx.caches.models.get_or_load(key, load)
        return loaded
