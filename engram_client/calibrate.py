"""The client calls of calibration (``POST /models/{id}/calibrate``, the result, the front's PNG), as
functions of an :class:`EngramClient`; the ``engram calibrate`` command is in :mod:`engram_client.cli`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from api_schemas import Calibration, CalibrationSubmission
from engram_client.client import PNG_SIGNATURE, EngramClient, EngramError, _quote, _set_only

# ---------------------------------------------------------------- client calls


def calibrate(
    client: EngramClient,
    model_id: str,
    concepts: Sequence[str],
    forget: Sequence[dict[str, Any]],
    retain: Sequence[dict[str, Any]],
    **options: Any,
) -> CalibrationSubmission:
    """``POST /models/{model_id}/calibrate``; options left ``None`` are not sent (the service's defaults apply)."""
    body = {"concepts": list(concepts), "forget": list(forget), "retain": list(retain), **_set_only(**options)}
    response = client._request("POST", f"/models/{_quote(model_id)}/calibrate", json=body)
    return CalibrationSubmission.model_validate_json(response.content)


def get_calibration(client: EngramClient, calibration_id: str) -> Calibration:
    """``GET /calibrations/{calibration_id}``: its status and, once done, its result."""
    return Calibration.model_validate_json(client._request("GET", f"/calibrations/{_quote(calibration_id)}").content)


def calibration_front_png(client: EngramClient, calibration_id: str) -> bytes:
    """The drawn front of a finished calibration (PNG bytes)."""
    headers = {"Accept": "image/png, application/problem+json"}
    response = client._request("GET", f"/calibrations/{_quote(calibration_id)}/front.png", headers=headers)
    if not response.content.startswith(PNG_SIGNATURE):
        raise EngramError(f"the front of calibration {calibration_id} is not a PNG")
    return response.content
