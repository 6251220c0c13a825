"""Calibration: search strength, scaling, modules and layers for the best edit under a constraint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from api_schemas import CalibrateRequest, Calibration, CalibrationSubmission
from engram_client.bodies import fields_body
from engram_client.errors import EngramError
from engram_client.transport import PNG_SIGNATURE, Transport, _quote


class CalibrationResource(Transport):
    """``/models/{id}/calibrate`` and ``/calibrations/{id}``; options from ``CalibrateRequest``."""

    def calibrate(
        self,
        model_id: str,
        concepts: Sequence[str],
        forget: Sequence[dict[str, Any]],
        retain: Sequence[dict[str, Any]],
        **options: Any,
    ) -> CalibrationSubmission:
        """``POST /models/{model_id}/calibrate``; ``options`` are the other fields of
        :class:`api_schemas.CalibrateRequest`, those left ``None`` not sent (the service's defaults apply).

        Raises:
            TypeError: an option is not a field of ``CalibrateRequest``.
        """
        given = {"concepts": concepts, "forget": forget, "retain": retain, **options}
        body = fields_body(CalibrateRequest, given)
        response = self._request("POST", f"/models/{_quote(model_id)}/calibrate", json=body)
        return CalibrationSubmission.model_validate_json(response.content)

    def get_calibration(self, calibration_id: str) -> Calibration:
        """``GET /calibrations/{calibration_id}``: its status and, once done, its result."""
        return self._parse(Calibration, self._request("GET", f"/calibrations/{_quote(calibration_id)}"))

    def calibration_front_png(self, calibration_id: str) -> bytes:
        """The drawn front of a finished calibration (PNG bytes)."""
        headers = {"Accept": "image/png, application/problem+json"}
        response = self._request("GET", f"/calibrations/{_quote(calibration_id)}/front.png", headers=headers)
        if not response.content.startswith(PNG_SIGNATURE):
            raise EngramError(f"the front of calibration {calibration_id} is not a PNG")
        return response.content
