"""Deleting a calibration (``DELETE /calibrations/{id}``): its records under ``calibrations/<id>/``.

What a calibration owns: its request, its result and its drawn front (``calibrations/<id>/``). What it
does not, and stays: its probes (``probes/<sha256>.json``, content-addressed: an identical evaluation
or calibration shares them), the variant it recommended and built (a variant in its own right,
possibly asked for by others), and its job's record (the job history, ``GET /jobs``).

Refused (409, nothing deleted) while its job is queued or running: cancel it first.
"""

from __future__ import annotations

from service.calibration.service import find_request
from service.context import Context
from service.errors import Conflict, NotFound
from service.jobs.store import FINISHED
from service.storage.keys import CALIBRATIONS, calibration_prefix, calibration_request_key


def delete_calibration(ctx: Context, calibration_id: str) -> list[str]:
    """Delete one calibration's records (under ``ctx.lock``: a submit of the same request waits).

    Returns:
        The keys deleted.

    Raises:
        NotFound: no such calibration (never was, or deleted already).
        Conflict: its job is not finished.
    """
    with ctx.lock:
        request = find_request(ctx, calibration_id)
        if request is None:
            raise NotFound(f"calibration {calibration_id} does not exist")
        job = ctx.jobs.get(request.job_id) if request.job_id else None
        if job is not None and job.status not in FINISHED:
            raise Conflict(
                f"calibration {calibration_id} is being computed by job {job.job_id} ({job.status}): nothing was "
                f"deleted. Cancel it (DELETE /jobs/{job.job_id}) or wait until it finishes, then delete it"
            )
        return remove_calibration(ctx, calibration_id)


def remove_calibration(ctx: Context, calibration_id: str) -> list[str]:
    """Delete the records (checks done by the caller): the request last, so that a deletion interrupted
    half-way still finds the calibration and can be repeated."""
    request = calibration_request_key(calibration_id)
    keys = [k for k in ctx.storage.list(calibration_prefix(calibration_id)) if k != request]
    for key in keys:
        ctx.storage.delete(key)
    ctx.storage.delete(request)
    return [*keys, request]


def model_calibrations(ctx: Context, model_id: str) -> list[str]:
    """The IDs of the calibrations of ``model_id`` (their requests name it)."""
    ids = {k.removeprefix(CALIBRATIONS).split("/")[0] for k in ctx.storage.list(CALIBRATIONS) if k.endswith("/request.json")}
    found = []
    for calibration_id in sorted(ids):
        request = find_request(ctx, calibration_id)
        if request is not None and request.model_id == model_id:
            found.append(calibration_id)
    return found
