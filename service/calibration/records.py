"""A calibration's stored files as frozen records, and their one reader each (issue 24).

``calibrations/<id>/request.json`` (:class:`StoredCalibrationRequest`, read by
:func:`read_calibration_request`) and ``calibrations/<id>/result.json``
(:class:`StoredCalibrationResult`, read by :func:`read_calibration_result`). Each is checked when
written and when read; a file that does not fit is refused naming the calibration and its first
wrong field (:class:`MalformedCalibration`), never passed on as a dict.

The stored keys are those calibrations have always been stored with. Older shapes read here only:
a request stored before data_weighted has arms without ``weighted`` (none was), one stored before
presets were skipped has no ``skipped_module_sets``; a request without an objective has no ``goal``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_schemas.calibration import CalibrationResult
from service.calibration.goal import GoalSpec
from service.errors import ServiceUnavailable, first_validation_error


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StoredArm(_Record):
    """An arm as stored (its data_weighted strengths are measured by the job, not stored)."""

    module_set: str
    modules: tuple[str, ...] | None
    layers: tuple[int, ...] | None
    scaling: Literal["uniform", "weight_norm"]
    weighted: bool = False


class StoredSearch(_Record):
    max_retain_nll_ratio: float
    budget: int
    alpha_min: float
    alpha_max: float
    arms: tuple[StoredArm, ...]


class StoredVariantFormat(_Record):
    format: Literal["checkpoint", "delta", "peft"]
    lora_rank: int | None
    lora_target: Literal["peft", "vllm"]


class StoredCalibrationRequest(_Record):
    """``request.json``: what the calibration's job reads (see :class:`~service.calibration.request.CalibrationRequest`)."""

    calibration_id: str
    model_id: str
    concepts: tuple[str, ...]
    term_stats: dict[str, str]
    universe_id: str
    reference: tuple[str, ...]
    probes_digest: str
    search: StoredSearch
    skipped_module_sets: tuple[str, ...] = ()
    variant: StoredVariantFormat
    job_id: str | None = None
    goal: GoalSpec | None = Field(default=None, exclude_if=lambda v: v is None)


class StoredCalibrationResult(CalibrationResult):
    """``result.json``: the calibration's answer as ``GET /calibrations/{id}`` shows it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class MalformedCalibration(ServiceUnavailable):
    """A stored calibration file this version cannot read."""

    def __init__(self, calibration_id: str, file: str, why: str) -> None:
        super().__init__(
            f"the {file} of calibration {calibration_id} cannot be read ({why}): remove calibrations/{calibration_id}/ "
            "from the store and submit the calibration again"
        )


def read_calibration_request(calibration_id: str, data: Any) -> StoredCalibrationRequest:
    """The stored request of ``calibration_id`` as a record.

    Raises:
        MalformedCalibration: not a calibration request, or another calibration's.
    """
    record = _read(StoredCalibrationRequest, calibration_id, "request.json", data)
    if record.calibration_id != calibration_id:
        raise MalformedCalibration(calibration_id, "request.json", f"it names calibration {record.calibration_id}")
    return record


def read_calibration_result(calibration_id: str, data: Any) -> StoredCalibrationResult:
    """The stored result of ``calibration_id`` as a record (same refusals as the request's reader)."""
    record = _read(StoredCalibrationResult, calibration_id, "result.json", data)
    if record.calibration_id != calibration_id:
        raise MalformedCalibration(calibration_id, "result.json", f"it names calibration {record.calibration_id}")
    return record


def checked_result(result: Mapping[str, Any]) -> StoredCalibrationResult:
    """A result the job assembled, as the record it is stored as (a shape bug fails the job here,
    before anything is stored)."""
    return StoredCalibrationResult.model_validate(dict(result))


R = TypeVar("R", bound=BaseModel)


def _read(model: type[R], calibration_id: str, file: str, data: Any) -> R:
    if not isinstance(data, Mapping):
        raise MalformedCalibration(calibration_id, file, f"a JSON {type(data).__name__}, not an object")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise MalformedCalibration(calibration_id, file, first_validation_error(exc)) from exc
