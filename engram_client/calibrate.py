"""The client calls of calibration as functions of an :class:`EngramClient` (kept for callers of
0.1.0; the methods of the same names on the client are the same calls). The ``engram calibrate``
command is in :mod:`engram_client.cli`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from api_schemas import Calibration, CalibrationSubmission
from engram_client.client import EngramClient


def calibrate(
    client: EngramClient,
    model_id: str,
    concepts: Sequence[str],
    forget: Sequence[dict[str, Any]],
    retain: Sequence[dict[str, Any]],
    **options: Any,
) -> CalibrationSubmission:
    """``POST /models/{model_id}/calibrate``: :meth:`EngramClient.calibrate`."""
    return client.calibrate(model_id, concepts, forget, retain, **options)


def get_calibration(client: EngramClient, calibration_id: str) -> Calibration:
    """``GET /calibrations/{calibration_id}``: :meth:`EngramClient.get_calibration`."""
    return client.get_calibration(calibration_id)


def calibration_front_png(client: EngramClient, calibration_id: str) -> bytes:
    """The drawn front of a finished calibration (PNG bytes): :meth:`EngramClient.calibration_front_png`."""
    return client.calibration_front_png(calibration_id)
