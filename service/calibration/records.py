"""A calibration's stored files as frozen records, and their one reader each (issue 24).

``calibrations/<id>/request.json`` is :class:`~service.calibration.request.CalibrationRequest`
itself (a :class:`StoredRecord`: its older shapes are named there) and ``calibrations/<id>/result.json``
is :class:`StoredCalibrationResult`, read by :func:`read_calibration_result`; its probes
(``probes/<sha256>.json``) are :class:`CalibrationProbes`. Each is checked when
written and when read (:func:`read_record`); a file that does not fit is refused naming the
calibration and its first wrong field (:class:`MalformedCalibration`), never passed on as a dict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from api_schemas.calibration import CalibrationResult
from service.errors import ServiceUnavailable, first_validation_error
from service.evaluation.records import ProbeJson
from service.storage.records import StoredRecord

__all__ = ["CalibrationProbes", "MalformedCalibration", "StoredCalibrationResult", "StoredRecord", "read_record"]


class CalibrationProbes(StoredRecord):
    """A calibration's probes (``probes/<sha256>.json``; the digest is part of its ID): forget and retain;
    with an objective also ``holdout`` and ``utility``; an image classifier's also ``test``. Only the
    sets the request set are stored (so a request without an objective has the ID it always had)."""

    forget: list[ProbeJson]
    retain: list[ProbeJson]
    test: list[ProbeJson] | None = None
    holdout: list[ProbeJson] | None = None
    utility: dict[str, list[ProbeJson]] | None = None

    def to_bytes(self) -> bytes:
        """The stored bytes: the sets set, keys sorted (their sha256 is the probes' digest)."""
        return json.dumps(self.model_dump(mode="json", exclude_unset=True), sort_keys=True, ensure_ascii=False).encode()

    def image_sets(self) -> dict[str, Sequence[ProbeJson] | None]:
        """The sets an image classifier's probes are read from (forget, retain, test)."""
        return {"forget": self.forget, "retain": self.retain, "test": self.test}


class StoredCalibrationResult(CalibrationResult):
    """``result.json``: the calibration's answer as ``GET /calibrations/{id}`` shows it."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class MalformedCalibration(ServiceUnavailable):
    """A stored calibration file this version cannot read."""

    def __init__(self, calibration_id: str, file: str, why: str) -> None:
        super().__init__(
            f"the {file} of calibration {calibration_id} cannot be read ({why}): remove calibrations/{calibration_id}/ "
            "from the store and submit the calibration again"
        )


def read_calibration_result(calibration_id: str, data: Any) -> StoredCalibrationResult:
    """The stored result of ``calibration_id`` as a record (same refusals as the request's reader)."""
    record = read_record(StoredCalibrationResult, calibration_id, "result.json", data)
    if record.calibration_id != calibration_id:
        raise MalformedCalibration(calibration_id, "result.json", f"it names calibration {record.calibration_id}")
    return record


R = TypeVar("R", bound=BaseModel)


def read_record(model: type[R], calibration_id: str, file: str, data: Any) -> R:
    """``data`` (a stored file of ``calibration_id``) as ``model``, or refused naming the file and its
    first wrong field."""
    if not isinstance(data, Mapping):
        raise MalformedCalibration(calibration_id, file, f"a JSON {type(data).__name__}, not an object")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise MalformedCalibration(calibration_id, file, first_validation_error(exc)) from exc
