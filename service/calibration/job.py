"""The ``calibrate`` kind's body, as the job table (:mod:`service.execution.kinds`) names it.

A calibration runs its recommended variant's ``variant`` job inline, in its own process
(:func:`service.calibration.build.run_calibration` says why); the runner hands every body the way
to do that as ``ctx.run_inline``, so this domain needs nothing of the execution package.
"""

from __future__ import annotations

from api_schemas.calibration import CalibrationJobResult
from service.calibration.build import run_calibration
from service.context import Context
from service.jobs.records import JobRecord


def run_calibration_job(ctx: Context, job: JobRecord) -> CalibrationJobResult:
    """Answer a stored calibration request, building its recommended variant inline.

    Raises:
        RuntimeError: ``ctx`` came from no runner (``ctx.run_inline`` unset): a wiring error.
    """
    if ctx.run_inline is None:
        raise RuntimeError("a calibration job runs through service.execution.runner.run_job, which sets ctx.run_inline")
    return run_calibration(ctx, job, ctx.run_inline)
