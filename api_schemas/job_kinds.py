"""Jobs typed by their kind: a finished job's ``result`` as the model of its kind.

The service answers every job as :class:`~api_schemas.Job` (``result``: a JSON object). A client
reads the job as the model :data:`JOB_MODELS` names for its kind, or as ``Job`` for a kind whose
result has no model of its own (collect, variant, universe, map, register).
"""

from __future__ import annotations

from typing import Literal

from api_schemas.calibration import CalibrationJobResult
from api_schemas.evaluation import EvaluationResult, GenerationResult
from api_schemas.jobs import Job


class EvaluateJob(Job):
    kind: Literal["evaluate"]
    result: EvaluationResult | None = None


class GenerateJob(Job):
    kind: Literal["generate"]
    result: GenerationResult | None = None


class CalibrateJob(Job):
    kind: Literal["calibrate"]
    result: CalibrationJobResult | None = None


JOB_MODELS: dict[str, type[Job]] = {"evaluate": EvaluateJob, "generate": GenerateJob, "calibrate": CalibrateJob}
