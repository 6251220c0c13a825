"""Job payloads for tests of the job machinery, where what the job is about does not matter."""

from __future__ import annotations

from typing import Any

from service.jobs.records import PAYLOADS, AnyPayload, JobKind

# One valid payload of each kind (the IDs name nothing stored: the bodies are not run with these).
SAMPLE_PAYLOADS: dict[JobKind, dict[str, Any]] = {
    "collect": {
        "model_id": "m",
        "model_digest": "d" * 64,
        "dataset_digest": "e" * 64,
        "settings": {"max_length": 64, "engine": "engram-service/1"},
        "concept": "c",
    },
    "variant": {"variant_id": "v" * 32, "model_id": "m"},
    "universe": {"universe_id": "u" * 32, "model_id": "m"},
    "evaluate": {"variant_id": "v" * 32, "probes_digest": "p" * 64, "evaluation_id": "e" * 32},
    "generate": {"variant_id": "v" * 32, "prompt": "Hello", "max_new_tokens": 4, "models": ["base", "variant"]},
    "calibrate": {"calibration_id": "k" * 32, "model_id": "m"},
    "map": {"map_id": "a" * 32, "model_id": "m"},
    "register": {"model_id": "m", "source": "file:///models/m"},
}


def payload_for(kind: JobKind, **fields: Any) -> AnyPayload:
    """A valid payload of ``kind``, with ``fields`` set over the sample's."""
    payload: AnyPayload = PAYLOADS[kind].model_validate({**SAMPLE_PAYLOADS[kind], **fields})  # type: ignore[assignment]
    return payload
