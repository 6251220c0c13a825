"""Registering a model: a ``file://`` folder in the request, a remote one (``s3://``, ``hf://``) as a job.

Registering a remote checkpoint downloads it and hashes every file the service uses: minutes and
gigabytes for a real model, which the API process (small, and answering other requests meanwhile)
must not do. The request checks what it can without reaching the source (the ID, the source's form,
an earlier registration of the same ID) and starts a ``register`` job, which a worker runs through
:func:`~service.models.registry.register_model`, exactly as a ``file://`` registration runs in the
request. The same registration posted while its job runs follows that job.

A ``file://`` folder is read in place, on the API's own disk, so it stays a request: its digest
reads the files once and needs no download.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.context import Context
from service.errors import Conflict
from service.jobs.store import new_job
from service.models.registry import find_model, register_model
from service.models.sources import check_remote_source, is_remote
from service.storage.keys import registration_key

_ACTIVE = ("queued", "running")


@dataclass(frozen=True)
class Registration:
    """A registration request's answer: the model's manifest when registered, else the job registering it.

    Attributes:
        manifest: the registration (``None`` while a job downloads the checkpoint).
        created: this request registered the model (``False``: it was registered already).
        job: the ``register`` job, while it runs.
    """

    manifest: dict[str, Any] | None
    created: bool
    job: dict[str, Any] | None


def request_registration(ctx: Context, model_id: str, source: str) -> Registration:
    """Register ``file://`` sources now; start (or follow) the job that registers a remote one.

    Raises:
        Conflict: the ID is registered, or being registered, with another source.
        InvalidInput: the source is malformed, or (``file://``) refused.
    """
    if not is_remote(source):
        manifest, created = register_model(ctx, model_id, source)
        return Registration(manifest, created, None)
    existing = _registered(ctx, model_id, source)
    if existing is not None:
        return Registration(existing, False, None)
    check_remote_source(source)
    with ctx.lock:
        existing = _registered(ctx, model_id, source)
        if existing is not None:
            return Registration(existing, False, None)
        running = registering_job(ctx, model_id)
        if running is not None:
            if running["payload"]["source"] != source:
                raise Conflict(f"model {model_id} is being registered with source {running['payload']['source']}")
            return Registration(None, False, running)
        job = ctx.jobs.create(new_job("register", {"model_id": model_id, "source": source}, unit="steps"))
        ctx.storage.put_json(registration_key(model_id), {"model_id": model_id, "source": source, "job_id": job["job_id"]})
    ctx.dispatch(job)
    return Registration(None, False, ctx.jobs.get(job["job_id"]) or job)


def registering_job(ctx: Context, model_id: str) -> dict[str, Any] | None:
    """The ``register`` job of ``model_id`` while it is queued or running, else None."""
    pending = ctx.storage.find_json(registration_key(model_id))
    job = ctx.jobs.get(pending["job_id"]) if pending and pending.get("job_id") else None
    return job if job is not None and job["status"] in _ACTIVE else None


def run_registration(ctx: Context, job: dict[str, Any]) -> dict[str, Any]:
    """The ``register`` job body: download and inspect the checkpoint, then write the registration
    (the manifest last: a failed download registers nothing)."""
    payload = job["payload"]
    ctx.jobs.set_progress(job["job_id"], 0, 1)
    manifest, created = register_model(ctx, payload["model_id"], payload["source"])
    ctx.jobs.set_progress(job["job_id"], 1, 1)
    return {"model_id": manifest["model_id"], "digest": manifest["digest"], "created": created}


def _registered(ctx: Context, model_id: str, source: str) -> dict[str, Any] | None:
    """The registration of ``model_id`` when it has this source; a 409 when it has another."""
    existing = find_model(ctx, model_id)
    if existing is not None and existing["source"] != source:
        raise Conflict(f"model {model_id} is already registered with source {existing['source']}")
    return existing
