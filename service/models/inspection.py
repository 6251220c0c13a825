"""The ``register`` job: download a checkpoint, inspect it and write its registration.

Inspecting builds the model on the ``meta`` device (torch and transformers) and hashes every file the
service uses, so it lives apart from the request side (:mod:`service.models.registration`) and the
registration reads (:mod:`service.models.registry`), which the API imports: only a process that runs
the job imports this module (``service.jobs.kinds`` names its body by import path).
"""

from __future__ import annotations

from typing import Any

from service.context import Context
from service.engine.checkpoint import check_tokenizer, directory_digest, inspect_model_dir
from service.engine.model_files import ModelSourceError
from service.errors import Conflict, InvalidInput
from service.jobs.store import utc_now
from service.models.registry import file_fingerprint, find_model
from service.models.sources import local_model_dir
from service.storage.keys import model_key


def run_registration(ctx: Context, job: dict[str, Any]) -> dict[str, Any]:
    """The ``register`` job body: download and inspect the checkpoint, then write the registration
    (the manifest last: a failed download registers nothing)."""
    payload = job["payload"]
    ctx.jobs.set_progress(job["job_id"], 0, 1)
    manifest, created = register_model(ctx, payload["model_id"], payload["source"])
    ctx.jobs.set_progress(job["job_id"], 1, 1)
    return {"model_id": manifest["model_id"], "digest": manifest["digest"], "created": created}


def register_model(ctx: Context, model_id: str, source: str) -> tuple[dict[str, Any], bool]:
    """Register a checkpoint; returns (manifest, created). Same registration twice is a no-op."""
    existing = find_model(ctx, model_id)
    if existing is not None:
        if existing["source"] != source:
            raise Conflict(f"model {model_id} is already registered with source {existing['source']}")
        return existing, False
    path = local_model_dir(source, ctx.settings.model_root_paths, ctx.cache_dir, ctx.settings.s3_endpoint_url)
    try:
        # Refuses links leading out of the folder and shard names that are not plain file names
        # in it (service.engine.model_files), before any of those files is opened.
        layout = inspect_model_dir(path)
        check_tokenizer(path)  # one no job could load is refused now, not at every collection
        digest, fingerprint = directory_digest(path), file_fingerprint(path)
    except ModelSourceError as exc:
        raise InvalidInput(str(exc)) from None
    if not layout.layers:
        raise InvalidInput("the model has no editable Linear or Conv1D layers in its safetensors weights")
    manifest = {
        "model_id": model_id,
        "source": source,
        "path": str(path),
        "digest": digest,
        "fingerprint": fingerprint,
        "architecture": layout.architecture,
        "num_parameters": layout.num_parameters,
        "layout": layout.to_json(),
        "registered_at": utc_now(),
    }
    with ctx.lock:
        again = find_model(ctx, model_id)
        if again is not None:
            return register_model(ctx, model_id, source)
        ctx.storage.put_json(model_key(model_id), manifest)
    return manifest, True
